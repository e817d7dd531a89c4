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


# --- model.path brings its tokenizer; another model's tokenizer is refused -------------------------------------------


def _model_dir(path, vocab_size: int, with_tokenizer: bool):
    """A checkpoint directory as far as the config sees it: the default job's tiny Qwen3-MoE config.json with
    `vocab_size`, and (optionally) the tool-use tiny tokenizer (76 tokens) saved beside it."""
    import json

    from omegaconf import OmegaConf

    from mcore_rl.data.tokenizer import TOOL_TOKENS

    hf = dict(OmegaConf.to_container(OmegaConf.load("configs/default.yaml"))["model"]["hf_config"])
    hf["vocab_size"] = vocab_size
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    if with_tokenizer:
        assert len(build_tiny_tokenizer(str(path), tools=True)) == len(VOCAB_TOKENS) + len(TOOL_TOKENS)
    return str(path)


def _config(model_path: str):
    from mcore_rl.config import RLConfig
    from mcore_rl.config.model import ModelConfig

    cfg = RLConfig(model=ModelConfig(path=model_path))
    cfg.validate()
    return cfg


def test_model_path_with_a_tokenizer_brings_its_tokenizer(tmp_path):
    """model.path holding tokenizer files and model.tokenizer unset: the run uses the checkpoint's tokenizer (as
    verl's model.path does), not the tiny built-in one, and the tokenizer check accepts it."""
    from mcore_rl.preflight import check_tokenizer

    path = _model_dir(tmp_path / "model", vocab_size=76, with_tokenizer=True)
    cfg = _config(path)
    assert cfg.model.tokenizer == path
    check_tokenizer(cfg)


def test_a_tokenizer_much_smaller_than_the_models_vocabulary_is_refused(tmp_path):
    """A real checkpoint without tokenizer files: the tiny tokenizer's 63 ids all fit below 49152, but they are not
    the model's; refused, naming both sizes (exit 2 in a run: a ConfigError)."""
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.preflight import check_tokenizer

    cfg = _config(_model_dir(tmp_path / "model", vocab_size=49152, with_tokenizer=False))
    assert cfg.model.tokenizer is None
    with pytest.raises(ConfigError, match=r"63 tokens, but the model's vocab_size is 49152"):
        check_tokenizer(cfg)
