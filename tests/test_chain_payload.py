"""chained_payload and _parent_text (producer/protocol.py): how a genq task run as a Celery chain or
chord child joins its parent's result to its request (docs/protocol.md section 10), as pure
functions; tests/test_celery_usage.py runs the same through a real worker."""

from __future__ import annotations

from typing import Any

import pytest

from producer.protocol import GenerationRequest, ProtocolError, _parent_text, chained_payload

GENQ_RESULT = {"id": "a", "attempt": 1, "text": "the sea", "finish_reason": "stop"}
CHAT = [{"role": "system", "content": "Be brief."}]


def test_without_a_parent_the_request_is_unchanged_even_with_chain_as():
    """A task sent on its own, or as an immutable signature (.si()), gets no positional argument."""
    for kwargs in ({"prompt": "Hi"}, {"prompt": "Hi", "chain_as": "prompt_suffix"},
                   {"messages": CHAT, "chain_as": "user"}):
        assert chained_payload(kwargs, ()) is kwargs
    GenerationRequest.parse_payload({"prompt": "Hi", "chain_as": "prompt_suffix"})


@pytest.mark.parametrize("mode", ["user", "assistant"])
def test_user_and_assistant_append_a_chat_turn_of_that_role(mode: str):
    kwargs = {"messages": CHAT, "chain_as": mode, "max_new_tokens": 8}
    joined = chained_payload(kwargs, (GENQ_RESULT,))
    assert joined == {**kwargs, "messages": [*CHAT, {"role": mode, "content": "the sea"}]}
    assert kwargs["messages"] == CHAT  # the signature's own kwargs are not changed
    assert GenerationRequest.parse_payload(joined).messages[-1].role == mode


def test_prompt_suffix_appends_to_the_prompt():
    assert chained_payload({"prompt": "Go on: ", "chain_as": "prompt_suffix"}, ("a plain string",)) == {
        "prompt": "Go on: a plain string", "chain_as": "prompt_suffix"}


def test_parent_text_reads_a_genq_result_a_string_or_a_groups_results_in_order():
    assert _parent_text(GENQ_RESULT) == "the sea"
    assert _parent_text("") == ""
    assert _parent_text([GENQ_RESULT, "two", {**GENQ_RESULT, "text": "three"}]) == "the sea\n\ntwo\n\nthree"
    assert _parent_text(["only"]) == "only"


@pytest.mark.parametrize("parent, problem", [
    (3, "chain: the parent's result must be a genq result (an object with text), a string or an array of those, "
        "got number 3"),
    ({"answer": "x"}, "chain: the parent's result must be a genq result (an object with text), a string or an "
                      "array of those, got object"),
    ({"text": 5}, "got object"),
    (None, "got null"),
    ([], "got an empty array"),
    ([GENQ_RESULT, ["a", "b"]], "chain: the parent's result[1] must be a genq result (an object with text) or a "
                                "string (a group's results are joined one level deep), got array"),
    (["a", 7], "chain: the parent's result[1] must be"),
])
def test_a_parent_result_without_text_is_refused_naming_its_shape(parent: Any, problem: str):
    with pytest.raises(ProtocolError) as raised:
        chained_payload({"prompt": "Go on: ", "chain_as": "prompt_suffix"}, (parent,))
    assert problem in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("kwargs, problem", [
    ({"prompt": "Then: "}, "chain_as: this task got its parent's result"),
    ({"messages": CHAT, "chain_as": "prompt_suffix"}, "chain_as: 'prompt_suffix' appends to prompt"),
    ({"prompt": "Then: ", "chain_as": "assistant"}, "chain_as: 'assistant' appends a chat turn to messages"),
    ({"input_ids": [1, 2], "chain_as": "user"}, "chain_as: 'user' appends a chat turn to messages"),
])
def test_a_request_chain_as_does_not_fit_is_refused_naming_chain_as(kwargs: dict[str, Any], problem: str):
    with pytest.raises(ProtocolError) as raised:
        chained_payload(kwargs, (GENQ_RESULT,))
    assert str(raised.value).startswith(problem)


def test_the_request_is_checked_before_the_parent_result():
    """Without chain_as the child's own request is what is wrong, whatever its parent returned."""
    with pytest.raises(ProtocolError, match="^chain_as: this task got"):
        chained_payload({"prompt": "x"}, (3,))


def test_more_than_one_positional_argument_is_refused():
    with pytest.raises(ProtocolError, match=r"^args: at most one positional argument .* got 2"):
        chained_payload({"prompt": "x", "chain_as": "prompt_suffix"}, ("a", "b"))


def test_an_unknown_chain_as_is_left_to_the_request_check_which_names_it():
    kwargs = {"prompt": "x", "chain_as": "system"}
    assert chained_payload(kwargs, ("a",)) is kwargs
    with pytest.raises(ProtocolError, match="^chain_as: "):
        GenerationRequest.parse_payload(kwargs)
