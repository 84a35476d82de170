"""OpenAI bodies and headers -> GenerateRequest: defaults, extensions, and every refusal."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.gateway.errors import HttpError
from thunderagent.gateway.protocol import (
    Defaults,
    _prompt,
    parse_chat,
    parse_completion,
    request_id_from,
)
from thunderagent.schemas import ChatMessage

NOW_MS = 1_700_000_000_000.0


def chat(body: dict, headers: dict | None = None, **kw):
    return parse_chat(json.dumps(body).encode(), headers or {}, request_id="r1", now_ms=NOW_MS,
                      **kw)  # fmt: skip


def completion(body: dict, headers: dict | None = None):
    return parse_completion(
        json.dumps(body).encode(), headers or {}, request_id="r1", now_ms=NOW_MS
    )


def refused(fn, body, headers=None) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(body, headers)
    assert info.value.status == 400
    return info.value


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_follow_openai():
    parsed = chat(BASE, defaults=Defaults(chat_max_tokens=77))
    req = parsed.request
    assert (parsed.chat, parsed.stream, parsed.include_usage) == (True, False, False)
    assert req.messages == [ChatMessage(role="user", content="hi")]
    assert req.request_id == "r1" and req.max_tokens == 77 and req.stream is False
    assert req.sampling.temperature == 1.0 and req.sampling.ignore_eos is False
    assert (req.priority, req.program_id, req.deadline_ms, req.cache_salt) == (0, None, None, None)


def test_chat_fields_are_forwarded():
    body = {**BASE, "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0, "top_p": 0.5,
            "stop": "END", "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "seed": 7, "presence_penalty": 0.1, "user": "u"}  # fmt: skip
    parsed = chat(body)
    req = parsed.request
    assert parsed.stream and parsed.include_usage and req.stream
    assert req.max_tokens == 9, "max_completion_tokens wins over the deprecated max_tokens"
    assert (req.sampling.temperature, req.sampling.top_p) == (0.0, 0.5)
    assert req.sampling.stop == ["END"] and req.sampling.ignore_eos is True


def test_content_parts_and_developer_role():
    body = {"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}  # fmt: skip
    assert chat(body).request.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="a\nb"),
    ]


def test_extensions_from_headers():
    headers = {"x-priority": "3", "x-session-id": "agent-7", "x-tenant-id": "acme",
               "x-timeout-ms": "2500"}  # fmt: skip
    req = chat(BASE, headers).request
    assert (req.priority, req.program_id, req.cache_salt) == (3, "agent-7", "acme")
    assert req.deadline_ms == NOW_MS + 2500
    assert chat(BASE, {"x-dynamo-session-id": "s"}).request.program_id == "s"
    assert chat(BASE, {"x-deadline-ms": "123.5"}).request.deadline_ms == 123.5


def test_body_extensions_win_over_headers():
    body = {**BASE, "priority": 1, "session_params": {"id": "sg"}, "cache_salt": "t1",
            "deadline_ms": 5.0, "nvext": {"agent_hints": {"osl": 40}}}  # fmt: skip
    headers = {"x-priority": "7", "x-session-id": "hdr", "x-tenant-id": "t2", "x-deadline-ms": "9"}
    req = chat(body, headers).request
    assert (req.priority, req.program_id, req.cache_salt, req.deadline_ms) == (1, "sg", "t1", 5.0)
    assert chat({**BASE, "program_id": "p", "session_id": "s"}).request.program_id == "p"
    assert chat({**BASE, "nvext": {"cache_salt": "nv"}}).request.cache_salt == "nv"
    if "expected_output_tokens" in type(req).__struct_fields__:
        assert req.expected_output_tokens == 40


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "missing required field"),
        ({"model": "m"}, "messages", "missing required field"),
        ({"model": "m", "messages": []}, "messages", "at least one"),
        ({**BASE, "max_tokens": "3"}, "max_tokens", "expected `int | null`, got `str`"),
        ({**BASE, "max_tokens": 0}, "max_tokens", "positive"),
        ({**BASE, "n": 2}, "n", "n > 1 is not supported"),
        ({**BASE, "temperature": 3}, "temperature", "between 0 and 2"),
        ({**BASE, "top_p": 0}, "top_p", "(0, 1]"),
        ({**BASE, "priority": 10}, "priority", "0 (most urgent) to 9"),
        ({**BASE, "logprobs": True}, "logprobs", "not supported"),
        ({**BASE, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ({**BASE, "response_format": {"type": "json_object"}}, "response_format", "only 'text'"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "is not one of"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "missing"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]", "only text parts"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model", "1-256"),
    ],
)  # fmt: skip
def test_chat_refusals_name_the_field(body, param, words):
    err = refused(chat, body)
    assert err.param == param
    assert words in err.message
    payload = json.loads(err.body())["error"]
    assert set(payload) == {"message", "type", "param", "code"}
    assert payload["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "words"),
    [(b"", "empty"), (b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object")],
)
def test_unreadable_bodies(raw, words):
    with pytest.raises(HttpError, match=words):
        parse_chat(raw, {}, request_id="r", now_ms=NOW_MS)


def test_bad_headers():
    for value in ("high", "-3", "10"):  # the header is named whichever way it is wrong
        assert "x-priority must be an integer" in refused(chat, BASE, {"x-priority": value}).message
    refused(chat, BASE, {"x-deadline-ms": "soon"})
    refused(chat, BASE, {"x-tenant-id": "t" * 300})
    with pytest.raises(HttpError):
        request_id_from({"x-request-id": "has space"})
    assert request_id_from({"x-request-id": "abc-1"}) == "abc-1"
    assert len(request_id_from({})) == 32


def test_completion_prompt_forms():
    assert completion({"model": "m", "prompt": "once"}).request.text == "once"
    assert completion({"model": "m", "prompt": [5, 6, 7]}).request.token_ids == [5, 6, 7]
    assert completion({"model": "m", "prompt": ["once"]}).request.text == "once"
    assert completion({"model": "m", "prompt": [[1, 2]]}).request.token_ids == [1, 2]
    parsed = completion({"model": "m", "prompt": "x"})
    assert parsed.request.max_tokens == 16 and parsed.chat is False


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "m", "prompt": ""}, "empty"),
        ({"model": "m", "prompt": []}, "empty"),
        ({"model": "m", "prompt": ["a", "b"]}, "batched prompts"),
        ({"model": "m", "prompt": [1, -2]}, "token ids"),
        ({"model": "m", "prompt": [1, 2**32]}, "token ids"),
        ({"model": "m", "prompt": [1, "a"]}, "string or a list of token ids"),
        ({"model": "m", "prompt": [1, True]}, "string or a list of token ids"),
        ({"model": "m", "prompt": [[1, -2]]}, "token ids"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "logprobs": 1}, "logprobs"),
        ({"model": "m"}, "missing required field `prompt`"),
    ],
)
def test_completion_refusals(body, words):
    assert words in refused(completion, body).message


_IDS = st.one_of(  # the two bounds of a token id, and anything between
    st.integers(-3, 3), st.integers(2**32 - 3, 2**32 + 3), st.integers(0, 2**32 - 1)
)
_PROMPTS = st.one_of(
    st.lists(_IDS, max_size=6),  # token ids, some out of range
    st.lists(
        st.one_of(_IDS, st.booleans(), st.text(max_size=2),
                  st.floats(allow_nan=False, allow_infinity=False)),
        max_size=6,
    ),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(_PROMPTS, st.booleans())
def test_a_token_prompt_is_taken_or_refused_as_the_general_check_says(items, batched) -> None:
    """msgspec checks the usual prompt (one list of token ids) as it decodes; the answer is
    the one the general check (``_prompt``) gives, for a valid prompt and every refusal."""
    prompt = [items] if batched else items
    try:
        expected = _prompt(json.loads(json.dumps(prompt)))
    except HttpError as err:
        assert refused(completion, {"model": "m", "prompt": prompt}).message == err.message
    else:
        req = completion({"model": "m", "prompt": prompt}).request
        assert (req.text if isinstance(expected, str) else req.token_ids) == expected


@pytest.mark.parametrize(
    ("model", "lora_path", "served", "expected"),
    [
        ("m", None, ["m"], ("m", None)),  # the base model
        ("m:sql", None, ["m"], ("m", "sql")),  # SGLang's <model>:<adapter>
        ("m", "sql", ["m"], ("m", "sql")),  # SGLang's lora_path
        ("m:sql", "chat", ["m"], ("m", "sql")),  # the model form wins, as in SGLang
        ("llama3:8b", None, ["llama3:8b"], ("llama3:8b", None)),  # a served name with ':'
        ("llama3:8b:sql", None, ["llama3:8b", "llama3"], ("llama3:8b", "sql")),  # longest wins
        ("x:y", None, [], ("x", "y")),  # nothing served yet: the first ':' splits
        ("m:", None, ["m"], ("m", None)),
    ],
)
def test_a_lora_adapter_is_named_as_sglangs_openai_api_names_it(model, lora_path, served, expected):
    body = {**BASE, "model": model, **({"lora_path": lora_path} if lora_path else {})}
    req = chat(body, served=served).request
    assert (req.model, req.lora_name) == expected


@pytest.mark.parametrize("model", [":", ":sql", " :sql"])
def test_an_adapter_without_a_model_is_refused(model):
    error = refused(chat, {**BASE, "model": model})
    assert "before ':<adapter>'" in str(error)
