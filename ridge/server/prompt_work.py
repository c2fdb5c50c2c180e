"""Prompts to token ids in worker threads, for the engine's front ends (ridge.server.engine_client,
ridge.ray_serve): the encoder releases the GIL (ridge.engine.prompts), so a megabyte prompt costs
its own request time, not every stream's next token."""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from ridge.engine.prompts import PromptEncoder, TokenizedPrompt
from ridge.server.engine_errors import EngineFailure

log = logging.getLogger("ridge.server")


@dataclass
class ChatPrompt:
    """Messages (and tools) to render with the checkpoint's chat template (in a tokenizer worker)."""
    messages: list[dict]
    tools: list[dict] | None = None


async def encode_in_worker(loop: asyncio.AbstractEventLoop, pool: Executor, encoder: PromptEncoder,
                           prompt: str | ChatPrompt, parse_special_tokens: bool) -> TokenizedPrompt:
    """Tokenize in a worker thread; waiting for a worker is bounded by the connection cap,
    and a client that leaves while queued takes its work item out of the queue."""
    if isinstance(prompt, ChatPrompt):
        work, text = functools.partial(encoder.chat, prompt.messages, prompt.tools), None
    else:
        work, text = functools.partial(encoder.encode, prompt, parse_special_tokens), prompt
    try:
        ids = await loop.run_in_executor(pool, work)
    except (ValueError, asyncio.CancelledError):
        raise
    except Exception as e:          # noqa: BLE001 - a tokenizer error fails this request, not the server
        log.exception("could not tokenize request")
        raise EngineFailure(f"the request could not be tokenized ({type(e).__name__})") from None
    return TokenizedPrompt(text, ids)
