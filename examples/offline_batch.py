"""Offline batch generation with the vLLM-style `LLM` API (the embedded demo model by default).

python examples/offline_batch.py [--model DIR]
"""

import argparse

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the",
    "The heavens declare",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL_DIR)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
    for out in llm.generate(PROMPTS, sampled):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")

    # Greedy, two completions with logprobs, and a chat turn.
    [greedy] = llm.generate("In the beginning", SamplingParams(temperature=0, max_tokens=24))
    print("greedy:", greedy.outputs[0].text)
    [pair] = llm.generate("Thou shalt", SamplingParams(n=2, temperature=1.0, max_tokens=16, logprobs=2, seed=1))
    for completion in pair.outputs:
        print(f"sample {completion.index}: {completion.text!r} (logprob {completion.cumulative_logprob:.2f})")
    [chat] = llm.chat([{"role": "user", "content": "Who made the heavens?"}], SamplingParams(max_tokens=32, seed=2))
    print("chat:", chat.outputs[0].text)
    print(llm.get_stats())


if __name__ == "__main__":
    main()
