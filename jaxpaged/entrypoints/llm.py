"""`LLM`: offline batch generation with vLLM's interface."""

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jaxpaged.config.defaults import DEMO_MODEL_NAME
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs, EngineArgsError, compatibility_notes
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.logging_setup import configure_default_logging
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.structured import check as check_constraint

PromptType = str | dict

logger = logging.getLogger("jaxpaged")


class LLM:
    """Generates text for batches of prompts with continuous batching over a paged KV cache.

    Args:
      model: a Hugging Face or converted model directory, a preset name (with
        `load_format="dummy"`), or "demo" (the default): the tiny demo model shipped in the
        package (jaxpaged/demo_model, a 4M-parameter Llama that writes King-James-flavoured
        English), for trying the API without a download.
      **kwargs: any other `EngineArgs` field (vLLM's names): `dtype`, `max_model_len`,
        `gpu_memory_utilization`, `kv_cache_memory_bytes`, `max_num_seqs`, `seed`,
        `load_format`, ... ; each field's help text says what it does.

    Raises:
      TypeError: a keyword that is not an `EngineArgs` field.
      EngineArgsError: a bad value (a ValueError naming the field).

    Example:
      >>> llm = LLM("path/to/model")
      >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
      >>> outs[0].outputs[0].text
    """

    def __init__(self, model: str = DEMO_MODEL_NAME, **kwargs):
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(
                f"LLM got unknown keyword arguments {unknown}; the engine takes {sorted(fields - {'model'})}"
            )
        configure_default_logging()
        args = EngineArgs(model=model, **kwargs)
        _refuse_replicas(args.data_parallel_size)
        for note in compatibility_notes(args):
            logger.info(note)
        self._start(LLMEngine.from_engine_args(args))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        """An `LLM` over options already resolved against the model (`EngineConfig.resolve`),
        which it does not resolve again (`jaxpaged generate` resolves its flags to check them
        before JAX loads)."""
        _refuse_replicas(config.parallel.data_parallel_size)
        configure_default_logging()
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without `sampling_params`: `SamplingParams`' defaults,
        overridden by the model's generation_config.json (see `EngineArgs.generation_config`)."""
        return self.llm_engine.config.default_sampling_params()

    def get_stats(self) -> dict[str, float | int]:
        """KV-cache and scheduler statistics (see `LLMEngine.get_stats`)."""
        return self.llm_engine.get_stats()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; returns their final outputs in input order.

        Args:
          prompts: a string, a `{"prompt": ...}` / `{"prompt_token_ids": [...]}` dict, or a list of
            them (anything else is a ValueError naming it).
          sampling_params: one for all prompts, or one per prompt (default
            `get_default_sampling_params()`: the model's generation config).
          use_tqdm: show a progress bar.
          lora_request: the LoRA adapter every prompt runs with, or one (or None: the base model)
            per prompt; the engine needs `enable_lora=True`.

        Raises:
          ValueError: a bad prompt or parameter (nothing is left queued then).
        """
        if self.llm_engine.is_paused() or self.llm_engine.is_sleeping():
            state = "paused (resume_generation())" if self.llm_engine.is_paused() else "asleep (wake_up())"
            raise RuntimeError(f"generate: the engine is {state}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"got {len(loras)} lora_request for {len(prompts)} prompts; pass one or one per prompt"
                )
        ids = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)  # only final outputs are kept
                request_id = str(next(self._ids))
                if sp.structured_outputs is not None:  # a bad constraint raises here, not in its output
                    check_constraint(sp.structured_outputs)
                self.llm_engine.add_request(request_id, prompt, sp, lora_request=lora)
                ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(ids)
            self.llm_engine.step() if ids else None  # deliver the aborts so nothing lingers
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation (a list of
        `{"role", "content"}` messages) or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(
                "chat needs the tokenizer's chat template; this LLM was made with skip_tokenizer_init=True"
            )
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=False
            )
            # The template writes the special tokens itself (BOS included).
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- in a training loop (see `jaxpaged.engine.training_loop`) ---------------------------

    def get_params(self):
        """The engine's parameter state (`LLMEngine.get_params`): its own arrays, not copies."""
        return self.llm_engine.get_params()

    def get_graphdef(self):
        """The model's structure (`LLMEngine.get_graphdef`)."""
        return self.llm_engine.get_graphdef()

    def update_weights(self, weights):
        """New weights, served from the next step on (`LLMEngine.update_weights`: the
        parameter pytree, or Hugging Face `(name, array)` pairs)."""
        return self.llm_engine.update_weights(weights)

    def init_lora(self, rank: int, target_modules=None, seed: int = 0):
        """A new LoRA adapter for the model, B zeros (`LLMEngine.init_lora`), for a trainer."""
        return self.llm_engine.init_lora(rank, target_modules, seed)

    def update_lora(self, lora_name: str, adapter):
        """Serves a trainer's LoRA adapter (`LLMEngine.update_lora`); returns the `LoRARequest`
        that runs with it."""
        return self.llm_engine.update_lora(lora_name, adapter)

    def reload_weights(self) -> None:
        """The checkpoint's weights again (`LLMEngine.reload_weights`)."""
        self.llm_engine.reload_weights()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's name)."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Frees the engine's device memory (`LLMEngine.sleep`: level 1 keeps the weights in host
        memory, level 2 discards them)."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Takes the device memory again (`LLMEngine.wake_up`)."""
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self, profile_dir: str) -> None:
        """Starts a `jax.profiler` trace of this process into `profile_dir` (`LLMEngine.start_profile`)."""
        self.llm_engine.start_profile(profile_dir)

    def stop_profile(self) -> str:
        """Stops the trace and writes it; returns its run's directory (`LLMEngine.stop_profile`)."""
        return self.llm_engine.stop_profile()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(ids) and self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update()
        return [finished[i] for i in ids]


def _refuse_replicas(data_parallel_size: int) -> None:
    """Offline, one `LLM` is one engine: replicas are the server's."""
    if data_parallel_size > 1:
        raise EngineArgsError(
            "data_parallel_size",
            data_parallel_size,
            "replicas are served by jaxpaged serve --data-parallel-size; an LLM is one engine (run one per "
            "group of devices, or leave it at 1)",
        )
