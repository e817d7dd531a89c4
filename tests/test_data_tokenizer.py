"""Tests for the tiny offline tokenizer: ids, round trips, the ChatML template, and reloading from disk."""

import os

import pytest
from transformers import AutoTokenizer

from mcore_rl.data.tokenizer import VOCAB_TOKENS, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(None)


def test_vocab_is_small_with_fixed_special_ids(tokenizer):
    assert len(tokenizer) == len(VOCAB_TOKENS) == 63
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.unk_token_id == 3
    assert tokenizer.bos_token is None


@pytest.mark.parametrize("text", ["repeat: 7", "hello world\n#### 42", "\\boxed{1/2} (x+y)*3 = -4.5, ok?!", ""])
def test_encode_decode_round_trips_text_in_alphabet(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_digits_and_task_words_are_single_tokens(tokenizer):
    for word in ["0", "7", "9", "repeat", "next", "assistant"]:
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word


def test_characters_outside_alphabet_map_to_unk(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False)
    assert ids == [tokenizer.unk_token_id, tokenizer.convert_tokens_to_ids("i")]


def test_chat_template_produces_expected_token_sequence(tokenizer):
    messages = [{"role": "user", "content": "repeat: 7"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nrepeat: 7<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a plain list of ids.
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    expected_tokens = ["<|im_start|>", "user", "\n", "repeat", ":", " ", "7", "<|im_end|>", "\n"]
    expected_tokens += ["<|im_start|>", "assistant", "\n"]
    assert tokenizer.convert_ids_to_tokens(ids) == expected_tokens
    # Decoding without special tokens leaves the plain text around the markers.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nrepeat: 7\nassistant\n"


def test_chat_template_without_generation_prompt_renders_every_turn(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "next: 3"},
        {"role": "assistant", "content": "4"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nnext: 3<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_saved_tokenizer_reloads_with_autotokenizer(tokenizer, tmp_path):
    out_dir = str(tmp_path / "tok")
    build_tiny_tokenizer(out_dir)
    assert "tokenizer.json" in os.listdir(out_dir)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp")], "temporary directory left behind"
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    messages = [{"role": "user", "content": "repeat: 5"}]
    assert reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    text = "repeat: 5\n#### 12"
    assert reloaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert (reloaded.pad_token_id, reloaded.eos_token_id, len(reloaded)) == (0, 2, 63)
