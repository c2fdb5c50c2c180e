"""The server's own settings: where it listens, its name for the model, the API key, and the
caps on a request. The engine's settings are `ridge.config.EngineConfig`; `ridge serve` takes
both, its flags generated from the two dataclasses (ridge.settings).

Limits the engine enforces itself (the context length, n against max_n, the value ranges of
SamplingParams) are not repeated here; these caps are what only a server needs, because an
HTTP request is untrusted and each of them bounds memory or time spent on one request.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridge import settings
from ridge.engine.sampling_params import MAX_LOGPROBS
from ridge.server.reasoning_parsers import REASONING_PARSERS
from ridge.server.tool_parsers import PARSERS
from ridge.settings import setting


def _non_empty(value) -> str | None:
    return "must not be empty" if value == "" else None


@dataclass
class ServerConfig:
    model_name: str = setting(None, flag="--served-model-name", check=_non_empty,
                              help="the model's name in the API", default_text="its directory name")
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8000, minimum=0, maximum=65535, help="port to listen on (0: any free port)")
    api_key: str | None = setting(None, check=_non_empty, help="require 'Authorization: Bearer KEY' on /v1/*",
                                  default_text="$RIDGE_API_KEY if set, else none")
    max_logprobs: int = setting(MAX_LOGPROBS, minimum=0, maximum=MAX_LOGPROBS,
                                help=f"cap on logprobs / top_logprobs (at most {MAX_LOGPROBS})")
    max_stop: int = setting(16, minimum=1, help="cap on the number of stop strings")
    max_stop_chars: int = setting(256, minimum=1,
                                  help="cap on the length of one stop string (a stream holds back this many)")
    max_prompts: int = setting(16, minimum=1, help="cap on prompts in one /v1/completions request")
    max_body_bytes: int = setting(4 << 20, minimum=1, help="request body limit (413 before it is read)")
    tokenizer_pool_size: int = setting(2, minimum=1, maximum=64,
                                       help="threads that tokenize prompts and render chat templates, beside the "
                                            "engine thread (a long prompt never stalls the running streams)")
    shutdown_timeout: float = setting(5.0, minimum=0,
                                      help="on SIGTERM or Ctrl-C, seconds the requests in flight may run on while "
                                           "new ones get 503; then each still running ends with a 503 (a stream: an "
                                           "error event, then [DONE]). 5 s leaves room within docker stop's 10 s")
    request_read_timeout: float = setting(30.0, above=0,
                                          help="seconds a client has to send a whole request, headers and body, "
                                               "from its connection or its first byte; then the connection is "
                                               "closed (408 once the headers were read)")
    timeout_keep_alive: float = setting(5.0, above=0, help="seconds an idle keep-alive connection stays open")
    limit_concurrency: int | None = setting(None, minimum=1,
                                            help="cap on open connections: a request on one more gets 503",
                                            default_text="no cap")
    tool_call_parser: str | None = setting(None, choices=tuple(PARSERS),
                                           help='how tool_choice "auto" reads the calls in a model\'s text: hermes '
                                                '(calls in tool_call tags: Hermes, Qwen 2.5 and 3, the bundled demo models\' '
                                                'template), llama3_json (Llama 3.x JSON calls), mistral ([TOOL_CALLS]). '
                                                'Without one, a request with tools must set tool_choice to "none", '
                                                '"required" or a named function',
                                           default_text="none")
    reasoning_parser: str | None = setting(None, choices=tuple(REASONING_PARSERS),
                                           help="split a reasoning model's thinking (<think>...</think>) out of its "
                                                "chat answers into reasoning / reasoning_content, before the tool-call "
                                                "parser reads the rest: deepseek_r1 (the output starts inside the "
                                                "reasoning: DeepSeek R1, QwQ, templates that open <think> in the "
                                                "prompt), qwen3 (reasoning only where the output opens with <think>). "
                                                "/v1/completions is not split",
                                           default_text="none")
    ray: bool = setting(False, help="serve on Ray Serve (ridge.ray_serve): replicas of the engine, each with its own "
                                    "KV cache, behind one OpenAI ingress that routes each request to the replica "
                                    "holding its prefix (else the least loaded); joins the Ray cluster of RAY_ADDRESS "
                                    "or starts a local one")
    num_replicas: int = setting(1, minimum=1, help="--ray: engine replicas (with --max-replicas: the autoscaler's "
                                                   "minimum)")
    max_replicas: int | None = setting(None, minimum=1,
                                       help="--ray: autoscale between --num-replicas and this many replicas on "
                                            "their queue length (Ray Serve's autoscaling_config)",
                                       default_text="no autoscaling")
    target_ongoing_requests: float = setting(16.0, above=0, help="--ray: requests in flight per replica the "
                                                                 "autoscaler aims for")
    max_ongoing_requests: int = setting(256, minimum=1, help="--ray: requests one replica holds at once (running "
                                                             "and waiting in its engine); more wait in the ingress")
    log_level: str = setting("info", choices=("critical", "error", "warning", "info", "debug"), help="log level")

    def __post_init__(self):
        settings.validate(self)
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas: must be at least num_replicas ({self.num_replicas}), got "
                             f"{self.max_replicas}")
