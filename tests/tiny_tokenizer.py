"""A tiny byte-level BPE tokenizer trained inside the tests (no downloads), sized to the tiny models."""

import itertools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 = pad, BOS, EOS of tiny_models.BASE
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _corpus() -> list[str]:
    """Syllable words (plenty of merges to learn) plus multi-byte characters."""
    syllables = ["".join(p) for p in itertools.product("bdfklmnprstv", "aeiou")]
    words = [a + b for a, b in itertools.product(syllables[:24], syllables[::3])]
    text = " ".join(words) + ". The quick brown fox jumps over the lazy dog, again and again!"
    extra = "naïve café — ✓ déjà vu, Straße, 東京, emoji 🙂; numbers 0123456789 and punctuation !?.,;:()[]{}"
    return [text, extra] * 4


def save_tokenizer(out_dir: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE of at most `vocab_size` tokens and saves it (HF format) to `out_dir`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(out_dir)
    return fast
