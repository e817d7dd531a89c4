"""A tiny tokenizer for the default CPU job, built offline (no HF hub access needed).

The default job trains a randomly initialised 2-layer MoE on a synthetic digit task (see `synthetic.py`), so it
needs a tokenizer that is small (the embedding and output layers scale with the vocabulary), deterministic, and
loadable like any HF tokenizer by the rollout engine and the actor: `AutoTokenizer.from_pretrained(out_dir)`.

Design: a `tokenizers` WordLevel model over single characters plus a handful of whole words
(`user`, `assistant`, `repeat`, ...). A regex pre-tokenizer cuts text into "a known word, else one character";
the `Fuse` decoder glues tokens back without inserting spaces, so `decode(encode(text)) == text` for any text in
the alphabet. Characters outside the alphabet (e.g. upper case) map to `<unk>`.

Special tokens follow Qwen's ChatML: `<|endoftext|>` pads, `<|im_end|>` ends a turn (eos), `<|im_start|>` opens one;
no bos (Qwen has none either). The chat template renders
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message and `<|im_start|>assistant\\n` as the generation prompt.

    python -m mcore_rl.data.tokenizer /tmp/tiny_tok   # writes tokenizer.json, tokenizer_config.json, chat_template
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"

# Order fixes the ids: specials first so their ids (0..3) never move when the alphabet grows.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)

# Whole-word tokens: the chat roles and the synthetic task's instruction words. Keeping them as single tokens makes
# prompts short (12 tokens for "repeat: 7" with the chat template), which matters for a 2-layer model.
WORD_TOKENS: tuple[str, ...] = ("repeat", "next", "user", "assistant", "system")

DIGITS: tuple[str, ...] = tuple("0123456789")
LETTERS: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz")
# Whitespace plus the punctuation the built-in rewards parse: "#### 42" (GSM8K), "\boxed{1/2}" (math), "-3.5".
PUNCTUATION: tuple[str, ...] = (" ", "\n") + tuple(":.,?!#+-=\\{}()*/")

VOCAB_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + WORD_TOKENS + DIGITS + LETTERS + PUNCTUATION

# Tool-use vocabulary (`build_tiny_tokenizer(tools=True)`, the multi-turn job): appended after the 63 tokens above,
# so the default job's ids and vocabulary size never move. Qwen3/Hermes tool markup as whole tokens, the characters
# JSON needs beyond PUNCTUATION, and the synthetic lookup call's fixed JSON head as one word (a real BPE tokenizer
# merges such frequent strings too; for a 2-layer model trained from scratch it keeps a call 5 tokens long).
TOOL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "lookup", "arguments": {"key": ',
    "}}",
    "lookup",
    '"',
    "_",
    "[",
    "]",
    "<",
    ">",
)

# ChatML, as Qwen2/Qwen3 render it without tools or thinking. `-` trims template whitespace so the output is exact.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def _split_pattern(words: tuple[str, ...] = WORD_TOKENS) -> str:
    """Regex for the pre-tokenizer: a known word first, else any single character (newline included)."""
    # Longest words first, so a word that is a prefix of another never wins the alternation.
    words = tuple(sorted(words, key=len, reverse=True))
    return "|".join(re.escape(w) for w in words) + r"|[\s\S]"


def build_tiny_tokenizer(out_dir: str | None = None, tools: bool = False) -> PreTrainedTokenizerFast:
    """Build the tiny ChatML tokenizer and, when `out_dir` is given, save it there.

    Args:
        out_dir: directory to write `tokenizer.json`, `tokenizer_config.json` and the chat template into (created if
            missing; files are written to a temporary sibling directory first and moved in one by one, so a crash
            never leaves a half-written file). `None` builds in memory only.
        tools: append `TOOL_TOKENS` (ids 63 and up) for tool calls and responses; the model's vocab_size must then be
            `len(VOCAB_TOKENS) + len(TOOL_TOKENS)`.

    Returns:
        A fast tokenizer with `len(tokenizer) == len(VOCAB_TOKENS)` (63), pad id 0, `<|im_start|>` id 1,
        eos `<|im_end|>` id 2, unk id 3, and a ChatML chat template.
    """
    tokens = VOCAB_TOKENS + (TOOL_TOKENS if tools else ())
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tiny tokenizer: VOCAB_TOKENS/TOOL_TOKENS hold a duplicate token")
    # Multi-character tool tokens are words of the pre-tokenizer (single characters match anyway).
    words = WORD_TOKENS + (tuple(t for t in TOOL_TOKENS if len(t) > 1) if tools else ())

    backend = Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_split_pattern(words)), behavior="isolated")
    # WordLevel's default decoding joins tokens with spaces; Fuse concatenates them, which is exact here because
    # spaces and newlines are tokens of their own.
    backend.decoder = decoders.Fuse()

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # prompts are left-padded for generation, as in verl
    )
    if out_dir is not None:
        _save_atomically(tokenizer, out_dir)
    return tokenizer


def _save_atomically(tokenizer: PreTrainedTokenizerFast, out_dir: str) -> None:
    """save_pretrained into a temporary sibling directory, then move each file into `out_dir`."""
    out_dir = os.path.abspath(out_dir)
    if os.path.islink(out_dir):  # its target's tokenizer files would be overwritten
        raise ValueError(
            f"{out_dir} is a symbolic link; the run writes only into directories of its own in trainer.run_dir: "
            "remove it, or choose another trainer.run_dir"
        )
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp_tokenizer_", dir=parent)
    try:
        tokenizer.save_pretrained(tmp_dir)
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(tmp_dir):
            os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m mcore_rl.data.tokenizer OUT_DIR` writes the tiny tokenizer to OUT_DIR."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mcore_rl.data.tokenizer OUT_DIR", file=sys.stderr)
        return 2
    tokenizer = build_tiny_tokenizer(args[0])
    print(f"wrote tiny tokenizer ({len(tokenizer)} tokens) to {args[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
