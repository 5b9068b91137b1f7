"""rljax.envs.formats: model turns sorted into tool calls, answers and void turns, for the tag,
Qwen2.5 and Hermes formats; observations rendered as each chat template renders a tool result."""

import json

import pytest

from rljax.envs import FORMATS, get_format
from rljax.errors import ConfigError

TAGS, QWEN, HERMES = FORMATS["tags"], FORMATS["qwen"], FORMATS["hermes"]
CHAT_METHODS = ("boxed", "answer_tag")


@pytest.mark.parametrize("turn, kind, payload", [
    ("<tool>123*456</tool>", "tool_call", "123*456"),
    ("let me compute <tool> 12 + 3 </tool>", "tool_call", "12 + 3"),
    ("<tool>1+1</tool> and then junk the stop sequence should have cut", "tool_call", "1+1"),
    ("<tool>123*4", "void", None),                      # cut off mid-call by the token budget
    ("", "void", None),
    ("   \n ", "void", None),
    ("56088", "answer", "56088"),
    ("work\n56088\n", "answer", "56088"),
    ("<answer>7</answer>", "answer", "7"),
    ("</tool>7", "answer", "</tool>7"),                  # a close tag alone opens no call
])
def test_tag_format_sorts_hand_written_turns(turn, kind, payload):
    """Each hand-written turn is read as the kind, call body or answer written beside it.

    Catches: a parser that treats an unclosed <tool> as a call or as an answer (SimpleTIR's void
    turn would slip through the filter), that keeps the whitespace around the body, that ignores the
    answer tag, or that raises on empty text."""
    parsed = TAGS.parse(turn)
    assert parsed.kind == kind
    if kind == "tool_call":
        assert parsed.call.name is None and parsed.call.arguments == {"input": payload}
        assert parsed.call.error is None and parsed.answer is None
    else:
        assert parsed.answer == payload and parsed.call is None


@pytest.mark.parametrize("fmt", [QWEN, HERMES], ids=["qwen", "hermes"])
@pytest.mark.parametrize("turn, kind, name, arguments, error", [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
     "tool_call", "python", {"code": "print(1)"}, None),
    ('I will check.\n<tool_call>\n{"arguments": {"expression": "2*3"}, "name": "calculator"}\n</tool_call>',
     "tool_call", "calculator", {"expression": "2*3"}, None),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>',
     "tool_call", "calculator", {"expression": "1"}, None),   # arguments sent as a JSON string
    ("<tool_call>\n{'arguments': {'code': 'x=1'}, 'name': 'python'}\n</tool_call>",
     "tool_call", "python", {"code": "x=1"}, None),          # Hermes-2-Pro's single quotes
    ('<tool_call>\n{"name": "python", "arguments": {"code": "x"}\n</tool_call>',
     "tool_call", None, {}, "not valid JSON"),
    ("<tool_call>\n__import__('os').system('true')\n</tool_call>", "tool_call", None, {}, "not valid JSON"),
    ('<tool_call>\n{"arguments": {"code": "x"}}\n</tool_call>', "tool_call", None, {}, "needs"),
    ('<tool_call>\n{"name": "python", "arguments": [1, 2]}\n</tool_call>',
     "tool_call", "python", {}, "JSON object"),
    ('<tool_call>\n{"name": "python", "argu', "void", None, None, None),
    ("The answer is \\boxed{56088}.<|im_end|>", "answer", None, None, None),
    ("<answer>12</answer><|im_end|>", "answer", None, None, None),
    ("I am not sure.<|im_end|>", "void", None, None, None),
])
def test_json_formats_sort_calls_and_malformed_calls(fmt, turn, kind, name, arguments, error):
    """Complete calls parse to name and arguments in either key order, as JSON or as a Python
    dict literal (Hermes-2-Pro's single quotes); malformed bodies, a missing name or non-object
    arguments give a call carrying an error (an error observation, never an exception); a cut-off
    call and text without an answer are void.

    Catches: json.loads errors escaping the parser, a parser that drops the call on bad JSON
    (making it void instead of a tool error the model can read), one that requires "name" first,
    a literal fallback that evaluates code (eval would run the os.system call), and answer
    extraction that sees "<|im_end|>" as part of the last line."""
    parsed = fmt.parse(turn, CHAT_METHODS)
    assert parsed.kind == kind
    if kind == "tool_call":
        assert (parsed.call.name, dict(parsed.call.arguments)) == (name, arguments)
        assert (parsed.call.error is None) if error is None else (error in parsed.call.error)
    if kind == "answer":
        assert parsed.answer in ("56088", "12")


@pytest.mark.parametrize("fmt", [TAGS, QWEN, HERMES], ids=["tags", "qwen", "hermes"])
def test_render_then_parse_round_trips(fmt):
    """render_call's text parses back to the same call, and ends with the stop sequence.

    Catches: a renderer and parser that disagree on the delimiters or on the JSON layout, and a
    stop sequence that is not the end of a rendered call (the sampler would not stop there)."""
    name, args = (None, {"input": "123 * 456"}) if fmt is TAGS else ("calculator", {"expression": "1/3"})
    text = fmt.render_call(name, args)
    assert text.endswith(fmt.stop_sequence)
    parsed = fmt.parse("thinking... " + text)
    assert parsed.kind == "tool_call" and parsed.call.name == name and dict(parsed.call.arguments) == args


def test_chat_exchanges_match_the_templates():
    """A call followed by its observation is, character for character, what Qwen2.5's chat
    template and Hermes-2-Pro's prompt format render for [assistant with a tool call, tool result]
    followed by the generation prompt.

    Catches: observation prefixes or suffixes that drift from the templates (a wrong role, a missing
    newline, the result outside <tool_response>), which would show a chat model text it was never
    trained on."""
    call = {"name": "calculator", "arguments": {"expression": "2+2"}}
    qwen_template = ('<|im_start|>assistant\nLet me add.\n<tool_call>\n{"name": "calculator", '
                     '"arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>\n'
                     "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
    turn = "Let me add.\n" + QWEN.render_call(call["name"], call["arguments"])
    assert "<|im_start|>assistant\n" + turn + QWEN.render_observation("4", "calculator") == qwen_template
    hermes_template = ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
                       '{"expression": "2+2"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n'
                       '<tool_response>\n{"name": "calculator", "content": "4"}\n</tool_response>\n'
                       "<|im_end|>\n<|im_start|>assistant\n")
    turn = HERMES.render_call(call["name"], call["arguments"])
    assert "<|im_start|>assistant\n" + turn + HERMES.render_observation("4", "calculator") == hermes_template
    assert json.loads(HERMES.render_observation('a "quoted"\nline', "python").split("\n")[3]) == {
        "name": "python", "content": 'a "quoted"\nline'}
    assert TAGS.render_observation("4") == "<result>4</result>"


def test_unknown_format_is_one_line_config_error():
    """An unknown format name raises a one-line ConfigError that lists the known formats.

    Catches: a KeyError from the table, or a message that does not say what to choose."""
    with pytest.raises(ConfigError) as err:
        get_format("chatml")
    message = str(err.value)
    assert "\n" not in message and "'chatml'" in message and "hermes, qwen, tags" in message
