"""The serving mode's messages: the OpenAI-compatible requests users send, and the signed
messages of workers and validators (covey.protocol.schemas.Signed: signature over the
endpoint, run and body, with a fresh nonce). Every field is bounded here, before a
handler reads it; a body that does not parse is a 422 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from covey.protocol.schemas import PeerId, RunId, Signed

MAX_TOKENS_CAP = 4096  # the most tokens any message carries (ServeConfig.max_tokens <= it)
MAX_PROMPT_CAP = 65536
JobId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class _Sampling(BaseModel):
    """The sampling fields shared by completions and chat (OpenAI's names and ranges)."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields covey ignores

    model: str | None = Field(None, max_length=200)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: Stop | list[Stop] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt (a string, or a list of one string)."""

    prompt: (
        Annotated[str, StringConstraints(max_length=1 << 20)]
        | list[Annotated[str, StringConstraints(max_length=1 << 20)]]
    ) = Field(..., description="the prompt")

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"one prompt per request, got {len(self.prompt)}")
        return self.prompt[0]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str = Field(max_length=1 << 20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, StringConstraints(max_length=1 << 20)] | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)


# -- workers and validators --------------------------------------------------------------


class Job(BaseModel):
    """A request as a worker sees it: what to generate and the seed it must use."""

    job_id: JobId
    prompt_ids: list[TokenId] = Field(..., min_length=1, max_length=MAX_PROMPT_CAP)
    max_tokens: int = Field(..., ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(..., gt=0, le=2)
    top_p: float = Field(..., gt=0, le=1)
    seed: int = Field(..., ge=0, lt=1 << 64)
    eos_id: int | None = None
    segment: int = Field(
        0, ge=0, le=MAX_TOKENS_CAP, description="stream this many tokens at a time (0: none)"
    )


class PullRequest(Signed):
    """POST /v1/serve/pull: one of a worker's slots asks for a request (a long-poll). A slot
    pulls when it is free: what it held before is given back to the queue."""

    run_id: RunId
    peer_id: PeerId
    slot: int = Field(0, ge=0, lt=64, description="which of the worker's slots (< worker_slots)")


class AnswerSubmit(Signed):
    """POST /v1/serve/answer: the tokens a worker generated for a job it was given, with
    the inference proof of their hidden states (covey.rl.proofs, hex)."""

    run_id: RunId
    peer_id: PeerId
    job_id: JobId
    tokens: list[TokenId] = Field(..., max_length=MAX_TOKENS_CAP)
    proof: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{2})*$", max_length=1 << 17)]


class ProgressSubmit(Signed):
    """POST /v1/serve/progress: the tokens generated so far for a streamed job (each
    segment's, as it is done): passed on to the user at once, and bound to the answer,
    which must extend them."""

    run_id: RunId
    peer_id: PeerId
    job_id: JobId
    tokens: list[TokenId] = Field(..., min_length=1, max_length=MAX_TOKENS_CAP)


class ClaimRequest(Signed):
    """POST /v1/serve/claim: a validator asks for an answer to re-check."""

    run_id: RunId
    peer_id: PeerId


class ReportRequest(Signed):
    """POST /v1/serve/report: a validator's verdict on the answer it claimed."""

    run_id: RunId
    peer_id: PeerId
    answer_id: int = Field(..., ge=1, lt=1 << 62)
    ok: bool
    problem: str | None = Field(None, max_length=64)
    detail: str = Field("", max_length=500)
