"""Tokenizers built from GGUF metadata: tiny files of both kinds (byte-level BPE and SentencePiece
BPE) round-trip, keep special tokens whole, add BOS exactly as told, stream as they decode and
merge as their merges or scores say; the real SmolLM2 and Gemma 3 files give llama.cpp's ids."""

import pytest
from gguf_files import (byte_level_tokens, real_model_path, sentencepiece_tokens,
                        write_gguf)

from mlx_spec.gguf.reader import read_metadata
from mlx_spec.gguf.tokenizer import PRE_TOKENIZERS, load_tokenizer

# None starts with a space: mlx-lm's byte-level streaming detokenizer drops a leading one (as it
# does for every Hugging Face BPE model), where decode keeps it.
TEXTS = [
    "Hello world",
    "naïve café, déjà vu; Ærøskøbing",
    "日本語のテキスト、中文",
    "emoji 🤖🦤 and 👩‍👩‍👧 family",
    "two  spaces,   three, and\ttabs\t\there",
    "lines\n\nand\r\nmore\n\n\n",
    "def f(x):\n    return x ** 2  # square\n",
    "1234567890 + 3.14159 = ?",
]

GPT2_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GPT2_MERGES = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2",
               "3 4", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "Ġ t", "Ġt he"]
SPM_PIECES = ["▁t", "he", "▁the", "ll", "▁he", "llo", "▁hello", "hello", "or", "▁w", "▁wor",
              "ld", "▁world", "▁▁", "ab", "bc", "▁", "a", "b", "c", "d", "e", "h", "l", "o", "r",
              "t", "w", "1", "2"]


def build(tmp_path, name="tokenizer.gguf", **fields):
    """Write a GGUF file with these fields, read it back and build its tokenizer."""
    return load_tokenizer(read_metadata(write_gguf(tmp_path / name, **fields)))


def gpt2_fields(merges=GPT2_MERGES, control=GPT2_CONTROL, **fields):
    tokens, types = byte_level_tokens(merges, control=control, user_defined=("<think>",))
    return dict(model="gpt2", pre="gpt-2", tokens=tokens, token_types=types, merges=merges,
                bos=control.index("<|im_start|>"), eos=control.index("<|im_end|>"),
                chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                              "{{ m['content'] }}<|im_end|>\n{% endfor %}") | fields


def spm_fields(pieces=SPM_PIECES, **fields):
    """A Llama-2-like SentencePiece vocabulary: <unk> <s> </s>, bytes, pieces."""
    tokens, types, scores = sentencepiece_tokens(pieces)
    return dict(model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
                unk=0, bos=1, eos=2) | fields


def gemma_like_fields(**fields):
    """A Gemma-like one: no space prefix, turn markers, user-defined HTML and whitespace runs."""
    tokens, types, scores = sentencepiece_tokens(
        SPM_PIECES, control=("<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        user_defined=("<b>", "  ", "   "))
    return dict(model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
                unk=0, eos=1, bos=2, add_bos=True, add_space_prefix=False) | fields


def ids_of(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(token) for token in tokens]


def streamed(tokenizer, ids):
    """The text the streaming detokenizer shows, checking no half character is ever shown."""
    detokenizer = tokenizer.detokenizer
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
        assert "\ufffd" not in segments[-1]
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert "".join(segments) == detokenizer.text
    return detokenizer.text


# Byte-level BPE ("gpt2")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpt2"), **gpt2_fields())


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip_and_stream(gpt2, text):
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert streamed(gpt2, ids) == text


def test_byte_level_merges_give_the_ids(gpt2):
    assert gpt2.encode("hello world") == ids_of(gpt2, "hello", "Ġworld")
    assert gpt2.encode(" the") == ids_of(gpt2, "Ġthe")
    assert gpt2.encode("1234") == ids_of(gpt2, "12", "34")  # GPT-2 keeps digit runs whole
    assert gpt2.encode("a     b") == ids_of(gpt2, "a", "ĠĠĠĠ", "Ġ", "b")


def test_byte_level_special_tokens_are_one_id_and_no_bos_by_default(gpt2):
    ids = gpt2.encode("<|im_start|>user\nhello<think>x<|im_end|>")
    assert ids == ids_of(gpt2, "<|im_start|>", "u", "s", "e", "r", "Ċ", "hello", "<think>", "x",
                         "<|im_end|>")
    assert gpt2.decode(ids) == "<|im_start|>user\nhello<think>x<|im_end|>"
    assert gpt2.decode(ids, skip_special_tokens=True) == "user\nhello<think>x"
    assert gpt2.eos_token_ids == {GPT2_CONTROL.index("<|im_end|>")}


def test_byte_level_chat_template(gpt2):
    text = gpt2.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n"
    assert gpt2.apply_chat_template([{"role": "user", "content": "hello"}])[0] == 1


def test_byte_level_bos_and_eos_when_the_file_says(tmp_path):
    tokenizer = build(tmp_path, **gpt2_fields(add_bos=True, add_eos=True))
    assert tokenizer.encode("hello") == ids_of(tokenizer, "<|im_start|>", "hello", "<|im_end|>")
    assert tokenizer.encode("hello", add_special_tokens=False) == ids_of(tokenizer, "hello")


def test_byte_level_ids_follow_the_file(tmp_path, gpt2):
    """More control tokens ahead shift every id; a missing merge leaves its pieces apart."""
    extra = ("<a>", "<b>", "<c>")
    shifted = build(tmp_path, "shifted.gguf", **gpt2_fields(control=GPT2_CONTROL + extra))
    for text in TEXTS:
        assert shifted.encode(text) == [i + len(extra) for i in gpt2.encode(text)]
    fewer = build(tmp_path, "fewer.gguf", **gpt2_fields(merges=GPT2_MERGES[:3]))
    assert fewer.encode("hello") == ids_of(fewer, "he", "llo")


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["12", "34"]), ("default", ["12", "3", "4"]), ("smollm", ["1", "2", "3", "4"]),
    ("llama-bpe", ["12", "3", "4"]), ("qwen2", ["1", "2", "3", "4"]),
])
def test_byte_level_pre_tokenizer_splits_digits_as_llama_cpp(tmp_path, pre, pieces):
    tokenizer = build(tmp_path, **gpt2_fields(pre=pre))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("1234", add_special_tokens=False)) \
        == pieces


@pytest.mark.parametrize("pre", sorted({split: name for name, split in PRE_TOKENIZERS.items()}
                                        .values()))
def test_every_known_pre_tokenizer_round_trips(tmp_path, pre):
    tokenizer = build(tmp_path, **gpt2_fields(pre=pre))
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_llama3_pre_tokenizer_adds_bos_unless_told_not_to(tmp_path):
    default = build(tmp_path, "a.gguf", **gpt2_fields(pre="llama-bpe"))
    assert default.encode("hello") == ids_of(default, "<|im_start|>", "hello")
    told = build(tmp_path, "b.gguf", **gpt2_fields(pre="llama-bpe", add_bos=False))
    assert told.encode("hello") == ids_of(told, "hello")


def test_unknown_pre_tokenizer_warns_and_splits_like_gpt2(tmp_path):
    with pytest.warns(UserWarning, match="pre-tokenizer 'mystery' is unknown"):
        tokenizer = build(tmp_path, **gpt2_fields(pre="mystery"))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("1234")) == ["12", "34"]


# SentencePiece BPE ("llama")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return build(tmp_path_factory.mktemp("spm"), **spm_fields())


@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gemma"), **gemma_like_fields())


@pytest.mark.parametrize("text", TEXTS + ["  leading spaces", "hello the world"])
@pytest.mark.parametrize("vocabulary", ["spm", "gemma_like"])
def test_sentencepiece_round_trip_and_stream(request, vocabulary, text):
    tokenizer = request.getfixturevalue(vocabulary)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert streamed(tokenizer, ids) == text


def test_sentencepiece_adds_bos_and_a_space_prefix_by_default(spm):
    assert spm.encode("hello world") == ids_of(spm, "<s>", "▁hello", "▁world")
    assert spm.decode(spm.encode("hello world"), skip_special_tokens=True) == "hello world"


def test_sentencepiece_without_space_prefix(gemma_like):
    assert gemma_like.encode("hello world") == ids_of(gemma_like, "<bos>", "hello", "▁world")
    assert gemma_like.eos_token_ids == set(ids_of(gemma_like, "<eos>", "<end_of_turn>"))


def test_sentencepiece_bos_eos_flags(tmp_path):
    assert build(tmp_path, "a.gguf", **spm_fields(add_bos=False)).encode("hello") \
        == build(tmp_path, "b.gguf", **spm_fields()).encode("hello", add_special_tokens=False)
    tokenizer = build(tmp_path, "c.gguf", **spm_fields(add_eos=True))
    assert tokenizer.encode("hello") == ids_of(tokenizer, "<s>", "▁hello", "</s>")


def test_sentencepiece_byte_fallback(spm):
    ids = spm.encode("é🦤", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(ids) == [
        "▁", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0xA6>", "<0xA4>"]


def test_sentencepiece_whole_tokens(gemma_like):
    text = "<start_of_turn>user\nhello<b>world   hello<end_of_turn>"
    ids = gemma_like.encode(text, add_special_tokens=False)
    assert gemma_like.convert_ids_to_tokens(ids) == [
        "<start_of_turn>", "<0x75>", "<0x73>", "e", "r", "<0x0A>", "hello", "<b>", "w",
        "or", "ld", "   ", "hello", "<end_of_turn>"]
    # Control tokens are special (skipped on request); user-defined ones are text.
    assert gemma_like.decode(ids, skip_special_tokens=True) == "user\nhello<b>world   hello"


def test_sentencepiece_scores_decide_the_merges(tmp_path):
    """"ab" outscoring "bc" cuts "abc" as ab|c; the other way round, a|bc."""
    first = build(tmp_path, "a.gguf", **spm_fields(add_space_prefix=False))
    assert first.convert_ids_to_tokens(first.encode("abc", add_special_tokens=False)) \
        == ["ab", "c"]
    swapped = [p for p in SPM_PIECES if p != "ab"]
    swapped.insert(swapped.index("bc") + 1, "ab")
    second = build(tmp_path, "b.gguf", **spm_fields(pieces=swapped, add_space_prefix=False))
    assert second.convert_ids_to_tokens(second.encode("abc", add_special_tokens=False)) \
        == ["a", "bc"]


# Errors


def test_no_tokenizer_in_the_file(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer in its metadata"):
        build(tmp_path)


def test_unknown_tokenizer_kind(tmp_path):
    with pytest.raises(ValueError, match="tokenizer kind 'bert' is not supported"):
        build(tmp_path, **spm_fields(model="bert"))


# The real files (downloaded once; skipped when absent)


def real_tokenizer(name):
    path = real_model_path(name)
    if path is None:
        pytest.skip(f"{name} is not in $MLX_SPEC_REAL_MODELS or ~/.cache/mlx-spec/real-models")
    return load_tokenizer(read_metadata(path))


@pytest.fixture(scope="module")
def smollm2():
    return real_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def gemma3():
    return real_tokenizer("gemma-3-270m-q4_k_m.gguf")


# Ids from llama.cpp (llama-cpp-python 0.3.36, Llama(path, vocab_only=True).tokenize(text,
# add_bos=True, special=True)), an implementation independent of this one.
SMOLLM2_IDS = {
    "Hello world": [19556, 905],
    "The quick brown fox jumps over the lazy dog.": [504, 2365, 6354, 16438, 27003, 690, 260,
                                                     23790, 2767, 30],
    "In 2024, 12 people paid $1,234.56.": [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 701, 5940,
                                           1885, 33, 28, 34, 35, 36, 30, 37, 38, 30],
    "naïve café 日本語 🦤": [3546, 46494, 37366, 17097, 241, 115, 40993, 179, 120, 248, 15107, 116,
                          114],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
    "def f(x):\n    return x ** 2\n": [1604, 275, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34,
                                      198],
}
GEMMA3_IDS = {
    "Hello world": [2, 9259, 1902],
    "The quick brown fox jumps over the lazy dog.": [2, 818, 3823, 8864, 37423, 38167, 1024, 506,
                                                     31770, 4799, 236761],
    "In 2024, 12 people paid $1,234.56.": [2, 902, 236743, 236778, 236771, 236778, 236812, 236764,
                                           236743, 236770, 236778, 1331, 6382, 609, 236770,
                                           236764, 236778, 236800, 236812, 236761, 236810,
                                           236825, 236761],
    "naïve café 日本語 🦤": [2, 1789, 238527, 560, 33443, 33375, 238582, 236743, 478, 397, 404, 402],
    "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107],
    "def f(x):\n    return x ** 2\n": [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123,
                                      5213, 236743, 236778, 107],
}


@pytest.mark.real_model
def test_smollm2(smollm2):
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.eos_token_ids == {2}
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.encode(" 2024") == ids_of(smollm2, "Ġ", "2", "0", "2", "4")
    for text, ids in SMOLLM2_IDS.items():
        assert smollm2.encode(text) == ids, text
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids) == text
        assert streamed(smollm2, ids) == text


@pytest.mark.real_model
def test_gemma3(gemma3):
    ids = gemma3.encode("Hello 🦤 2024")
    assert ids[0] == gemma3.convert_tokens_to_ids("<bos>") == 2
    assert gemma3.convert_ids_to_tokens(ids[1:]) == [
        "Hello", "▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0xA4>", "▁", "2", "0", "2", "4"]
    assert gemma3.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    for text, expected in GEMMA3_IDS.items():
        assert gemma3.encode(text) == expected, text
    for text in TEXTS:
        ids = gemma3.encode(text, add_special_tokens=False)
        assert gemma3.decode(ids) == text
        assert streamed(gemma3, ids) == text
