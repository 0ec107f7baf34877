"""Tool schemas come from signatures and docstrings (via pydantic), in the OpenAI/Qwen shape."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from omniloop.tools import Tool, ToolContext, format_tool_schemas, tool
from omniloop.tools.base import parse_docstring


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    x: int
    y: float = 0.0


def params(t: Tool) -> dict:
    return t.schema["function"]["parameters"]


def test_schema_has_the_openai_function_shape():
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    assert add.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }


def test_basic_types_map_to_json_schema_types():
    @tool
    def f(s: str, i: int, x: float, flag: bool, items: list[str], table: dict[str, int]) -> str:
        """F."""
        return ""

    props = params(f)["properties"]
    assert props["s"] == {"type": "string"}
    assert props["i"] == {"type": "integer"}
    assert props["x"] == {"type": "number"}
    assert props["flag"] == {"type": "boolean"}
    assert props["items"] == {"type": "array", "items": {"type": "string"}}
    assert props["table"] == {"type": "object", "additionalProperties": {"type": "integer"}}


def test_defaults_make_arguments_optional_and_appear_in_the_schema():
    @tool
    def f(a: int, b: int = 3, c: str | None = None) -> str:
        """F."""
        return ""

    schema = params(f)
    assert schema["required"] == ["a"]
    assert schema["properties"]["b"] == {"type": "integer", "default": 3}
    assert schema["properties"]["c"] == {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
    }


def test_literal_and_enum_become_enums():
    @tool
    def f(mode: Literal["fast", "slow"], color: Color = Color.RED) -> str:
        """F."""
        return ""

    schema = params(f)
    assert schema["properties"]["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    color = schema["properties"]["color"]
    assert color["default"] == "red"
    assert schema["$defs"]["Color"]["enum"] == ["red", "blue"]


def test_nested_pydantic_models_are_described_and_validated():
    @tool
    def f(points: list[Point], origin: Point | None = None) -> float:
        """F."""
        return sum(p.x for p in points)

    schema = params(f)
    assert schema["properties"]["points"]["items"] == {"$ref": "#/$defs/Point"}
    assert schema["$defs"]["Point"]["required"] == ["x"]
    assert schema["$defs"]["Point"]["properties"]["y"]["type"] == "number"
    kwargs = f.validate({"points": [{"x": 1}, {"x": "2", "y": 1.5}]})
    assert kwargs["points"] == [Point(x=1), Point(x=2, y=1.5)]
    assert kwargs["origin"] is None


def test_docstring_gives_description_and_parameter_descriptions():
    @tool
    def search(query: str, limit: int = 10) -> str:
        """Search the corpus for passages.

        Returns the best passages first. This paragraph is not part of the description.

        Args:
            query: What to look for,
                in plain words.
            limit (int): How many passages to return.

        Returns:
            The passages.
        """
        return ""

    assert search.description == "Search the corpus for passages."
    props = params(search)["properties"]
    assert props["query"]["description"] == "What to look for, in plain words."
    assert props["limit"]["description"] == "How many passages to return."


def test_annotated_field_description_wins_over_the_docstring():
    @tool
    def f(a: Annotated[int, Field(description="from the annotation", ge=0)]) -> int:
        """F.

        Args:
            a: from the docstring
        """
        return a

    prop = params(f)["properties"]["a"]
    assert prop["description"] == "from the annotation"
    assert prop["minimum"] == 0


def test_decorator_options_override_name_description_and_set_timeout():
    @tool(name="calc", description="Evaluate arithmetic.", timeout=2.5)
    def evaluate(expression: str) -> str:
        """Ignored description."""
        return expression

    assert evaluate.name == "calc"
    assert evaluate.description == "Evaluate arithmetic."
    assert evaluate.timeout == 2.5
    assert evaluate.schema["function"]["name"] == "calc"


def test_context_parameter_is_excluded_from_the_schema_whatever_its_name():
    @tool
    def f(code: str, environment: ToolContext) -> str:
        """F."""
        return code

    @tool
    def g(code: str, ctx: ToolContext | None = None) -> str:
        """G."""
        return code

    for t in (f, g):
        assert list(params(t)["properties"]) == ["code"]
        assert params(t)["required"] == ["code"]


async def test_sync_and_async_tools_have_the_same_schema_and_both_run():
    @tool
    def sync_double(n: int) -> int:
        """Double."""
        return 2 * n

    @tool
    async def async_double(n: int) -> int:
        """Double."""
        return 2 * n

    assert params(sync_double) == params(async_double)
    ctx = ToolContext()
    assert await sync_double.call({"n": 4}, ctx) == "8"
    assert await async_double.call({"n": "5"}, ctx) == "10"


def test_decorated_function_stays_directly_callable():
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    assert add(2, 3) == 5
    assert isinstance(add, Tool)


def test_parameter_names_that_shadow_basemodel_attributes_work():
    @tool
    def f(json: str, schema: str, copy: int = 1) -> str:
        """F."""
        return json + schema * copy

    assert list(params(f)["properties"]) == ["json", "schema", "copy"]
    assert f.validate({"json": "a", "schema": "b"}) == {"json": "a", "schema": "b", "copy": 1}


def test_unannotated_parameter_is_rejected_at_decoration():
    def f(a, b: int) -> int:  # type: ignore[no-untyped-def]
        return b

    with pytest.raises(TypeError, match="'a' needs a type annotation"):
        tool(f)


def test_var_args_are_rejected_at_decoration():
    def f(*values: int) -> int:
        return sum(values)

    with pytest.raises(TypeError, match="ordinary named parameter"):
        tool(f)


def test_bad_tool_name_is_rejected():
    with pytest.raises(ValueError, match="tool name"):
        tool(name="has space")(lambda: "")


def test_format_tool_schemas_lists_every_tool_schema_in_order():
    @tool
    def a() -> str:
        """A."""
        return ""

    @tool
    def b() -> str:
        """B."""
        return ""

    schemas = format_tool_schemas([a, b])
    assert [s["function"]["name"] for s in schemas] == ["a", "b"]
    assert schemas[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


def test_parse_docstring_handles_missing_and_sectionless_docstrings():
    assert parse_docstring(None) == ("", {})
    assert parse_docstring("One line.") == ("One line.", {})
    description, args = parse_docstring(
        """Two
        lines.

        Arguments:
            x: the x
        Raises:
            ValueError: never
        """
    )
    assert description == "Two lines."
    assert args == {"x": "the x"}


def test_rest_numpydoc_and_epydoc_parameter_sections_describe_parameters():
    def rest(query: str, limit: int = 10) -> str:
        """Search the corpus.

        :param query: What to look for,
            in plain words.
        :param int limit: How many passages to return.
        :returns: The passages.
        """
        return ""

    def numpydoc(query: str, limit: int = 10) -> str:
        """Search the corpus.

        Parameters
        ----------
        query : str
            What to look for,
            in plain words.
        limit : int, optional
            How many passages to return.

        Returns
        -------
        str
        """
        return ""

    def epydoc(query: str, limit: int = 10) -> str:
        """Search the corpus.

        @param query: What to look for,
            in plain words.
        @param limit: How many passages to return.
        """
        return ""

    for fn in (rest, numpydoc, epydoc):
        t = tool(fn)
        assert t.description == "Search the corpus.", fn.__name__
        props = params(t)["properties"]
        assert props["query"]["description"] == "What to look for, in plain words.", fn.__name__
        assert props["limit"]["description"] == "How many passages to return.", fn.__name__


def test_multi_paragraph_parameter_text_is_joined_and_attributes_are_not_parameters():
    description, args = parse_docstring(
        """Summary line
        that wraps.
        Args:
            x: first part

                second part.
        Attributes:
            y: an attribute, not a parameter
        """
    )
    assert description == "Summary line that wraps."
    assert args == {"x": "first part second part."}


def test_a_docstring_the_library_rejects_keeps_its_first_paragraph(monkeypatch):
    import docstring_parser

    def refuse(text: str) -> None:
        raise docstring_parser.ParseError("unparseable")

    monkeypatch.setattr(docstring_parser, "parse", refuse)
    assert parse_docstring("First\n    paragraph.\n\n    Args:\n        x: ignored\n") == (
        "First paragraph.",
        {},
    )
