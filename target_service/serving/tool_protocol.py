"""OpenAI's tools on a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and the calls in
an assistant message of the history.

- `tool_choice` "none": the tools are not shown to the model and nothing is read as a call;
- "auto" (the default with tools): the chat template renders them, and calls the model writes in
  its family's format (`tool_formats`) come back as `tool_calls`;
- "required", or {"type": "function", "function": {"name": ...}}: as auto, and the output is forced
  to be calls (to that function) whose arguments match its `parameters` schema, by the same grammar
  masks structured outputs use. Then no other structured output may be asked for.

Refused with a 400 naming the field: more than MAX_TOOLS tools, a name that is not OpenAI's
`^[a-zA-Z0-9_-]{1,64}$` or is given twice, a named choice (or required) without tools, a choice
naming a tool that is not there.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from target_service.serving.structured_fields import StrictPart

MAX_TOOLS = 128
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(StrictPart):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # forced calls always match the schema, strict or not


class ToolDefinition(StrictPart):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictPart):
    name: ToolName


class NamedToolChoice(StrictPart):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(StrictPart):
    name: str
    arguments: str  # JSON text


class ToolCall(StrictPart):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates read a call (transformers' convention): the arguments as an object."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            raise ValueError(f"tool call {self.id}: function.arguments is not JSON") from None
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ToolRefusal(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ToolFields(BaseModel):
    """Mixed into the chat request model."""

    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: true

    def check_tools(self) -> None:
        """The rules across the fields (`ToolRefusal`, naming the field)."""
        names = [tool.function.name for tool in self.tools or []]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ToolRefusal("tools", f"tools: the name {twice[0]!r} is given twice")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ToolRefusal("tool_choice", "tool_choice asks for a tool call but tools is empty or missing")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ToolRefusal("tool_choice", f"tool_choice names the function {choice.function.name!r}, "
                                             "which is not in tools")

    @property
    def uses_tools(self) -> bool:
        """Whether the model sees the tools and its calls are read back."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_functions(self) -> list[dict] | None:
        """The functions the output must call ({"name", "parameters"}), or None when not forced."""
        choice = self.tool_choice
        if not self.uses_tools or choice in (None, "auto"):
            return None
        functions = [{"name": tool.function.name, "parameters": tool.function.parameters}
                     for tool in self.tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
        return functions

    def tools_for_template(self) -> list[dict] | None:
        if not self.uses_tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]
