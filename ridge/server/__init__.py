"""ridge's OpenAI-compatible HTTP server (`ridge serve`).

    request_models.py pydantic models of the requests, built for the served model's limits
    request_tools.py  their tool-calling fields (tools, tool_choice, a history's calls); request_base.py
                      what both are made of (strict models, bounded numbers, rules over several fields)
    protocol.py       pydantic models of the OpenAI responses
    openapi.py        /openapi.json from those models
    errors.py         the OpenAI error shape, and the mapping of every failure onto a 4xx/5xx
    config.py         ServerConfig: the server's own caps and settings
    engine_client.py  the engine thread (sole owner of the engine) and its asyncio front end
    openai_serving.py what the endpoints share: engine requests, params, collecting, streaming, usage
    serving_completions.py  /v1/completions (echo, prompt logprobs)
    serving_chat.py   /v1/chat/completions
    chat_answers.py   what a sample's text becomes in its answers: reasoning split off, then tool calls
    reasoning_parsers.py  a reasoning model's <think> block out of its text (--reasoning-parser)
    chat_tools.py     tool calls in its answers, whole and streamed; tool_parsers.py reads a model's
                      own call format (--tool-call-parser)
    metrics.py        Prometheus metrics
    middleware.py     API-key check and the request-body size limit
    app.py            the FastAPI app: routes, error handlers, lifespan
    http_server.py    uvicorn for ridge: bind first, one log format, read timeout, connection cap, drain
    cli.py            `ridge serve`
    text_stream.py    stop-string-safe incremental text (shared with `ridge generate`)

Importing this package pulls in nothing heavy: `ridge generate` uses text_stream without FastAPI.
"""
