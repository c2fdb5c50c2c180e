"""What the request models (request_models.py, request_tools.py) are made of: strict models,
int64-bounded numbers, fields that take only the values this server can honour, and the rules over
several fields that are checked on every request and stated in /openapi.json as if/then.
"""
from dataclasses import dataclass
from typing import Annotated, Callable, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

INT64 = (-(1 << 63), (1 << 63) - 1)
CONFLICT = "conflicting_parameters"      # the error code of a combination of values that is refused
UNSUPPORTED = "is not supported by this server"


def _whole_number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(lo: int = INT64[0], hi: int | None = None):
    """An int64 in [lo, hi]; a whole-number float counts."""
    return Annotated[int, Field(ge=lo, le=INT64[1] if hi is None else hi), BeforeValidator(_whole_number)]


def number(lo: float, hi: float, above: bool = False):
    return Annotated[float, Field(gt=lo) if above else Field(ge=lo), Field(le=hi)]


def only(kind, *allowed, why: str = UNSUPPORTED):
    """A field of type `kind` that takes only the `allowed` values (what asks for nothing this
    server lacks); the schema lists them."""
    def check(value):
        if value not in allowed:
            raise PydanticCustomError("unsupported_value", why)
        return value
    return Annotated[kind, AfterValidator(check), WithJsonSchema({"enum": list(allowed)})]


SET = object()                            # Needs' value for "anything but null"


@dataclass(frozen=True)
class Needs:
    """A request whose `field` is `value` (SET: anything but null) must set `other` to true.
    Checked on every request and stated in the schema as an if/then."""
    field: str
    value: object
    other: str

    def violated(self, req) -> bool:
        v = getattr(req, self.field)
        return (v is not None if self.value is SET else v == self.value) and getattr(req, self.other) is not True

    def schema(self) -> dict:
        cond = {"not": {"type": "null"}} if self.value is SET else {"const": self.value}
        return {"if": {"properties": {self.field: cond}, "required": [self.field]},
                "then": {"properties": {self.other: {"const": True}}, "required": [self.other]}}

    def error(self) -> PydanticCustomError:
        what = "" if self.value is SET else f"{self.value!r} "
        return conflict(self.field, f"{what}is only allowed when {self.other} is true")


@dataclass(frozen=True)
class Rule:
    """A combination refused where `violated(req)`, stated in the schema as "if `when` then `then`";
    the error names `param`."""
    when: dict
    then: dict
    violated: Callable[[object], bool]
    param: str
    why: str

    def schema(self) -> dict:
        return {"if": self.when, "then": self.then}

    def error(self) -> PydanticCustomError:
        return conflict(self.param, self.why)


NEEDS_STREAM = Needs("stream_options", SET, "stream")


def conflict(param: str, why: str) -> PydanticCustomError:
    return PydanticCustomError(CONFLICT, f"{param}: {why}")


def _needs_schema(schema: dict, cls) -> None:
    if cls.NEEDS:
        schema["allOf"] = [r.schema() for r in cls.NEEDS]


class StrictModel(BaseModel):
    """A request body (or a part of one): strict types, unknown fields ignored, and the combinations
    its NEEDS rules refuse, checked on every request and stated in the schema."""
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", json_schema_extra=_needs_schema)
    NEEDS: ClassVar[tuple] = ()

    @model_validator(mode="after")
    def _combinations(self):
        for rule in type(self).NEEDS:
            if rule.violated(self):
                raise rule.error()
        return self
