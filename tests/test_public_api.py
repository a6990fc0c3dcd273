"""`import staticlm` gives what its docstring promises: every name of `__all__` resolves, to the object the model's
own methods use, and the docstring's example runs."""
from __future__ import annotations

import enum
import re
import subprocess
import sys
import typing

import pytest

import staticlm


@pytest.mark.parametrize("name", staticlm.__all__)
def test_every_public_name_resolves(name):
    value = getattr(staticlm, name)
    assert value.__name__ == name
    assert value.__module__.startswith("staticlm.")


def test_the_names_are_the_ones_model_uses():
    """The annotations of Model's methods name the classes a caller gets: resolved, they are the package's."""
    from staticlm.runtime.model import Model

    assert staticlm.Model is Model
    hints = typing.get_type_hints(Model.generate)
    assert hints["params"] == staticlm.GenerationParams | None
    assert hints["return"] is staticlm.GenerationResult
    assert typing.get_type_hints(Model.chat)["return"] is staticlm.ChatSession
    assert typing.get_type_hints(Model.open)["options"] == staticlm.RunOptions | None
    assert typing.get_type_hints(Model.default_params)["return"] is staticlm.GenerationParams
    assert typing.get_type_hints(staticlm.GenerationResult)["finish_reason"] is staticlm.FinishReason
    assert typing.get_type_hints(staticlm.GenerationParams)["sampling"] is staticlm.SamplingParams


def test_finish_reason_is_an_enum_of_every_reason_the_loop_reports():
    """Each `FinishReason.X` that the generation code writes is a member, and each member is written somewhere."""
    from pathlib import Path

    generate = Path(staticlm.__file__).parent / "runtime" / "generate"
    used = {m for path in generate.glob("*.py") for m in re.findall(r"FinishReason\.([A-Z_]+)", path.read_text())}
    assert issubclass(staticlm.FinishReason, enum.Enum)
    assert used == set(staticlm.FinishReason.__members__)


def test_errors_are_user_errors():
    assert issubclass(staticlm.InvalidOption, staticlm.UserError)
    assert issubclass(staticlm.ContextFull, staticlm.UserError)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'generator'"):
        staticlm.generator  # noqa: B018


def test_the_docstring_names_attributes_that_exist(tiny_chat_family):
    """`model.X` in the package docstring is an attribute of an opened model; one written as a call, `X()`, is a
    method, and one written without is not."""
    model = staticlm.Model.open(tiny_chat_family, staticlm.RunOptions(max_new_tokens=4, temperature=0),
                                warm_up=False)
    named = re.findall(r"`model\.(\w+)(\(?)", staticlm.__doc__)
    assert named
    for attribute, call in named:
        value = getattr(model, attribute)
        assert callable(value) == bool(call) or isinstance(value, type), attribute
    assert isinstance(model.generator, staticlm.Generator)
    assert isinstance(model.chat(), staticlm.ChatSession)
    params = model.default_params()
    assert isinstance(params, staticlm.GenerationParams)
    assert isinstance(params.sampling, staticlm.SamplingParams)
    result = model.generate([1, 2, 3])
    assert isinstance(result, staticlm.GenerationResult)
    assert isinstance(result.finish_reason, staticlm.FinishReason)
    assert result.finish_reason is staticlm.FinishReason.LENGTH and len(result.token_ids) == 4


def test_the_docstring_example_runs(tiny_chat_family):
    example = "\n".join(line[4:] for line in staticlm.__doc__.splitlines() if line.startswith("    "))
    assert "staticlm.Model.open" in example
    example = example.replace('"path/to/family"', repr(str(tiny_chat_family)))
    example = example.replace("temperature=0.7", "temperature=0.7, max_new_tokens=4")
    proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout
