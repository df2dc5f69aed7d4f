"""The model's generation_config.json sampling defaults: read, checked, and applied to the fields a request
leaves out, through the routes, the offline `LLM`, and a real server driven by the openai SDK."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from helpers_server import TEST_MODEL_NAME, asgi_client, served_engine

from mili_openai.config import EngineConfig
from mili_openai.engine.sampling_defaults import (
    describe_sampling_defaults,
    read_sampling_defaults,
    sampling_defaults_from,
)
from mili_openai.protocol.sampling import SamplingFields

# Qwen3-0.6B's generation_config.json as it ships (the keys that are not sampling fields are ignored)
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                           "transformers_version": "4.51.0"}
QWEN3_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
# top_k 1 keeps only the best token: sampling is greedy however it is seeded, so a test can see it
GREEDY_BY_DEFAULT = {"top_k": 1, "repetition_penalty": 1.0}
PROMPT = "The capital of France is"


def write_generation_config(directory, content) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(content))


def checkpoint_with(tmp_path, tiny_checkpoint, generation: dict):
    """A copy of the tiny checkpoint whose generation_config.json also holds `generation`."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    merged = json.loads((copy / "generation_config.json").read_text()) | generation
    write_generation_config(copy, merged)
    return copy


# ---- reading the file ----
def test_auto_reads_the_model_files_sampling_fields_only(tmp_path):
    write_generation_config(tmp_path, QWEN3_GENERATION_CONFIG)
    defaults = read_sampling_defaults("auto", tmp_path)
    assert defaults == QWEN3_DEFAULTS
    assert isinstance(defaults["top_k"], int) and isinstance(defaults["temperature"], float)


def test_none_ignores_the_file_and_auto_without_a_file_is_empty(tmp_path):
    write_generation_config(tmp_path / "with", QWEN3_GENERATION_CONFIG)
    assert read_sampling_defaults("none", tmp_path / "with") == {}
    (tmp_path / "without").mkdir()
    assert read_sampling_defaults("auto", tmp_path / "without") == {}


def test_a_named_directory_overrides_the_model_and_must_hold_the_file(tmp_path):
    write_generation_config(tmp_path / "model", QWEN3_GENERATION_CONFIG)
    write_generation_config(tmp_path / "mine", {"temperature": 0.2, "min_p": 0.05})
    assert read_sampling_defaults(str(tmp_path / "mine"), tmp_path / "model") == {"temperature": 0.2, "min_p": 0.05}
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_sampling_defaults(str(tmp_path / "empty"), tmp_path / "model")


def test_nulls_are_unset_and_whole_float_top_k_is_an_int():
    assert sampling_defaults_from({"temperature": None, "top_k": 20.0, "top_p": 1}, "f") == {"top_k": 20,
                                                                                               "top_p": 1.0}


@pytest.mark.parametrize("generation, message", [
    ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"top_k": 2.5}, "top_k"),
    ({"temperature": "0.6"}, "temperature"), ({"top_k": True}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"temperature": float("nan")}, "temperature"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_values_a_request_could_not_send_are_refused_naming_the_file(tmp_path, generation, message):
    write_generation_config(tmp_path, generation)
    with pytest.raises(ValueError, match=message) as error:
        read_sampling_defaults("auto", tmp_path)
    assert "generation_config.json" in str(error.value)


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_sampling_defaults("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        read_sampling_defaults("auto", tmp_path)


def test_the_startup_line_names_the_settings_and_how_to_turn_them_off():
    line = describe_sampling_defaults(QWEN3_DEFAULTS)
    assert "temperature=0.6" in line and "top_k=20" in line and "--generation-config none" in line
    assert "OpenAI's" in describe_sampling_defaults({})


# ---- applying them to a request ----
def test_omitted_fields_take_the_defaults_and_given_ones_win():
    params = SamplingFields().to_sampling_params(1000, QWEN3_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.95, 20, 0.0)
    own = SamplingFields(temperature=0.0, top_k=-1, top_p=1.0).to_sampling_params(1000, QWEN3_DEFAULTS)
    assert own.greedy and own.top_k == -1 and own.top_p == 1.0
    assert SamplingFields().to_sampling_params(1000, {}).temperature == 1.0  # OpenAI's default


@pytest.mark.anyio
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": TEST_MODEL_NAME, "prompt": PROMPT, "max_tokens": 3}),
    ("/v1/chat/completions", {"model": TEST_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 3}),
    ("/generate", {"prompt": PROMPT, "max_tokens": 3}),
])
async def test_every_route_applies_the_engines_defaults(fake_engine, path, body):
    fake_engine.info = dataclasses.replace(fake_engine.info, sampling_defaults=dict(QWEN3_DEFAULTS))
    async with asgi_client(fake_engine) as client:
        assert (await client.post(path, json=body)).status_code == 200
        assert (await client.post(path, json=body | {"top_p": 0.5, "top_k": 0})).status_code == 200
    defaulted, own = fake_engine.submitted[0][1], fake_engine.submitted[1][1]
    assert (defaulted.temperature, defaulted.top_p, defaulted.top_k) == (0.6, 0.95, 20)
    assert (own.temperature, own.top_p, own.top_k) == (0.6, 0.5, 0)


# ---- the real engine ----
def test_offline_llm_samples_with_the_models_defaults(tmp_path, tiny_checkpoint):
    from mili_openai.engine.llm import LLM
    from mili_openai.engine.sampling_params import SamplingParams

    checkpoint = checkpoint_with(tmp_path, tiny_checkpoint, GREEDY_BY_DEFAULT)
    llm = LLM(str(checkpoint), dtype="float32", num_pages=16)
    defaults = llm.get_default_sampling_params()
    assert defaults.top_k == 1 and defaults.temperature == 1.0
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert llm.generate(PROMPT)[0].outputs[0].token_ids == greedy  # max_tokens 16 either way
    plain = LLM(str(checkpoint), dtype="float32", num_pages=16, generation_config="none")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_a_bad_file_stops_the_engine_from_loading(tmp_path, tiny_checkpoint):
    from mili_openai.engine.async_engine import AsyncEngine

    checkpoint = checkpoint_with(tmp_path, tiny_checkpoint, {"top_p": 0})
    with pytest.raises(ValueError, match="top_p"):
        AsyncEngine(EngineConfig(model=str(checkpoint), dtype="float32", num_pages=8))


def test_real_server_samples_with_the_models_defaults_unless_told_not_to(tmp_path, tiny_checkpoint):
    """Through uvicorn and the openai SDK: with top_k 1 from the file, requests that name no sampling field
    are greedy (equal to temperature 0); `--generation-config none` brings back temperature-1 sampling."""
    from openai import OpenAI

    checkpoint = checkpoint_with(tmp_path, tiny_checkpoint, GREEDY_BY_DEFAULT)
    outputs = {}
    for source in ("auto", "none"):
        with served_engine(checkpoint, num_pages=32, generation_config=source) as (live, _):
            client = OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
            greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
            defaulted = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed)
                         for seed in (1, 2)]
            chat = client.chat.completions.create(model="tiny", max_tokens=24,
                                                  messages=[{"role": "user", "content": PROMPT}])
            chat_greedy = client.chat.completions.create(model="tiny", max_tokens=24, temperature=0,
                                                         messages=[{"role": "user", "content": PROMPT}])
        outputs[source] = (greedy.choices[0].text, [c.choices[0].text for c in defaulted],
                           chat.choices[0].message.content, chat_greedy.choices[0].message.content)
    greedy_text, defaulted_texts, chat_text, chat_greedy_text = outputs["auto"]
    assert defaulted_texts == [greedy_text, greedy_text] and chat_text == chat_greedy_text
    # without the file's top_k, two seeds at temperature 1 over Qwen3's vocabulary do not both land on greedy
    greedy_text, defaulted_texts, _, _ = outputs["none"]
    assert defaulted_texts != [greedy_text, greedy_text]
