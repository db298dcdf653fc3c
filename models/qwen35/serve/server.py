"""`zdsl serve`: the model behind an OpenAI-compatible HTTP API (starlette on uvicorn).

Routes: POST /v1/chat/completions, /v1/completions and /v1/responses (streamed as server-sent
events with `stream: true`), GET /v1/models, /health, /metrics and /props, POST /tokenize and /detokenize.
Generation is engine.py's; the protocol's checks are api.py's, the reply's shape reply.py's.
Every error a client can cause answers with OpenAI's error body and a 4xx status; anything else
with a 500 and the same body, the traceback only in the server's log. A request's body is read
up to MAX_BODY, and rendered and tokenized on a worker thread, so a large one does not hold up
the others.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import time
import uuid

import click

from zdsl.errors import ZdslError
from zdsl.kernels.kvcache import KVTypes
from zdsl.models.qwen35.cli.run import kv_type_option, spec_options
from zdsl.models.qwen35.serve.api import REASONING_FORMATS, ApiError, bad, chat_job, completion_job
from zdsl.models.qwen35.serve.engine import Engine
from zdsl.models.qwen35.serve.reply import Reply, chat_logprobs, completion_logprobs
from zdsl.models.qwen35.serve.responses import ResponseEvents, chat_body, named_as_responses, sse

log = logging.getLogger("zdsl.serve")
OPEN = {"/health"}  # routes that need no API key
MAX_BODY = 8 << 20  # bytes of a request body: a whole 262k-token context as text is ~1 MB


def merged(a: dict, b: dict) -> dict:
    """Two deltas of a reply as one (texts joined, calls' deltas listed)."""
    return a | {k: a[k] + v if k in a else v for k, v in b.items()}


def app(engine: Engine, model_id: str, api_key: str | None = None, *, reasoning_format: str = "auto",
        reasoning_budget: int | None = None):
    """The ASGI application serving `engine` as model `model_id` (any model name a request gives
    is taken to mean it, as llama-server does); `reasoning_format` and `reasoning_budget`: the
    defaults of requests that give none."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    tok = engine.tokenizer

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request):
        """The request's JSON: refused (413) beyond MAX_BODY before it is all read; one whose
        text cannot be UTF-8 (a lone surrogate) or that nests too deep for the parser, a 400."""
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB")
        try:
            body = json.loads(data)
            json.dumps(body, ensure_ascii=False).encode()
        except (ValueError, UnicodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body nests too deep") from None
        return body

    def job_of(body, chat: bool):
        try:
            if chat:
                return chat_job(body, tok, engine.n_ctx, engine.stop_ids, reasoning_format, reasoning_budget)
            return completion_job(body, tok, engine.n_ctx)
        except ZdslError as e:  # the chat template refused the messages
            raise ApiError(400, str(e), param="messages") from None

    def usage(p) -> dict:
        return {"prompt_tokens": p.prompt_tokens, "completion_tokens": p.completion_tokens,
                "total_tokens": p.prompt_tokens + p.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": p.reused_tokens}}

    async def complete(request, chat: bool):
        job = await run_in_threadpool(job_of, await body_of(request), chat)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_id}
        reply, offset = Reply(job), 0

        def logprobs(p):
            nonlocal offset
            if job.top_logprobs is None:
                return None
            if chat:
                return {"content": chat_logprobs(p.choices, tok)}
            out = completion_logprobs(p.choices, tok, offset)
            offset += len(p.text)
            return out

        def chunk(p, delta: dict | None, first: bool = False) -> dict:
            finish = None if first or not p.finish else reply.finish(p.finish) if chat else p.finish
            if not chat:
                return {"index": 0, "text": p.text, "logprobs": logprobs(p), "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if first else delta
            return {"index": 0, "delta": delta, "logprobs": None if first else logprobs(p), "finish_reason": finish}

        if job.stream:
            async def events():
                if chat:
                    yield f"data: {json.dumps(head | {'choices': [chunk(None, None, first=True)]})}\n\n"
                async for p in engine.run(job):
                    delta = merged(reply.add(p.text), reply.flush() if p.finish else {}) if chat else None
                    if (delta if chat else p.text) or p.choices or p.finish:
                        yield f"data: {json.dumps(head | {'choices': [chunk(p, delta)]})}\n\n"
                    if p.finish and job.include_usage:
                        yield f"data: {json.dumps(head | {'choices': [], 'usage': usage(p)})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        p = await whole(request, job)
        if p is None:
            return Response(status_code=499)
        if chat:
            reply.add(p.text)
            reply.flush()
            body = {"index": 0, "message": reply.message(), "logprobs": logprobs(p),
                    "finish_reason": reply.finish(p.finish)}
        else:
            body = chunk(p, None)
        return JSONResponse(head | {"object": "chat.completion" if chat else "text_completion",
                                    "choices": [body], "usage": usage(p)})

    async def whole(request, job):
        """The job's last piece holding all its text and choices; None where the client went away
        (the generation stopped, the slot freed)."""
        text, choices = [], []
        async with contextlib.aclosing(engine.run(job)) as pieces:
            async for p in pieces:
                text.append(p.text)
                choices += p.choices
                if await request.is_disconnected():
                    return None
        p.text, p.choices = "".join(text), choices
        return p

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def responses(request):
        body = await body_of(request)
        try:
            job = await run_in_threadpool(lambda: job_of(chat_body(body), chat=True))
        except ApiError as e:
            raise named_as_responses(e) from None
        response, reply = ResponseEvents(body, model_id), Reply(job)
        if job.stream:
            async def events():
                for e in response.start():
                    yield sse(e)
                async for p in engine.run(job):
                    for e in response.add(merged(reply.add(p.text), reply.flush() if p.finish else {})):
                        yield sse(e)
                    if p.finish:
                        for e in response.finish(p, reply.called):
                            yield sse(e)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        p = await whole(request, job)
        if p is None:
            return Response(status_code=499)
        response.add(merged(reply.add(p.text), reply.flush()))
        response.finish(p, reply.called)
        return JSONResponse(response.object)

    async def completions(request):
        return await complete(request, chat=False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model",
                                                         "created": int(engine.started), "owned_by": "zdsl"}]})

    async def tokenize(request):
        body = await body_of(request)
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise bad("content must be a string", "content")
        ids = await run_in_threadpool(tok.encode, content, parse_special=body.get("parse_special", True) is True)
        if body.get("with_pieces") is True:
            return JSONResponse({"tokens": [{"id": i, "piece": tok.piece(i).decode("utf-8", errors="replace")}
                                            for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request):
        body = await body_of(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < tok.vocab_size for t in ids):
            raise bad(f"tokens must be a list of token ids in [0, {tok.vocab_size})", "tokens")
        return JSONResponse({"content": tok.decode(ids)})

    async def props(request):
        return JSONResponse({"model_alias": model_id, "model_path": str(engine.slots[0].gen.model.path),
                             "total_slots": len(engine.slots), "chat_template": tok.chat_template,
                             "default_generation_settings": {"n_ctx": engine.n_ctx},
                             "reasoning_format": reasoning_format,
                             "reasoning_budget": -1 if reasoning_budget is None else reasoning_budget})

    async def health(request):
        return JSONResponse({"status": "ok", "slots_idle": len(engine.slots) - engine.busy,
                             "slots_processing": engine.busy, "requests_waiting": engine.waiting})

    async def metrics(request):
        return PlainTextResponse(engine.prometheus(), media_type="text/plain; version=0.0.4")

    async def on_api_error(request, e: ApiError):
        return error(e)

    async def on_http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind))

    async def on_crash(request, e: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return error(ApiError(500, f"the server failed on this request ({type(e).__name__}); its log has the details",
                              kind="server_error"))

    class Auth:
        """Requests other than /health must carry `Authorization: Bearer <api key>`."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["path"] not in OPEN:
                given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    e = ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                    return await error(e)(scope, receive, send)
            await self.inner(scope, receive, send)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/responses", responses, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/detokenize", detokenize, methods=["POST"]),
              Route("/props", props, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, middleware=[Middleware(Auth)] if api_key else [],
                     exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_engine(model, device, *, n_ctx: int, kv: KVTypes, checkpoint_mib: int, parallel: int = 1,
                say=None, speculate=None, draft_model=None) -> tuple[Engine, str]:
    """`parallel` slots on `model` (a path, or None: the synthetic default), reading one copy of
    its weights and decoding together, and its model id; `speculate`: each slot's drafts
    (speculate.Speculation; a slot that drafts steps alone, checking its drafts)."""
    import threading

    from zdsl.models.qwen35.model.batch import MOST, Batch
    from zdsl.models.qwen35.model.generate import Generator, load
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.serve.engine import Slot, Together
    from zdsl.runtime.memory import fmt_bytes

    gpu = threading.RLock()
    options = dict(n_ctx=n_ctx, sampler=SamplerConfig(), progress=say is not None, say=say, keep=True, kv=kv,
                   checkpoints=checkpoint_mib << 20, speculate=speculate)
    # the plan holds every slot
    first = Slot(lambda: load(model, device, slots=parallel, draft_model=draft_model, **options), gpu)
    slots, together = [first], None
    try:
        for _ in range(parallel - 1):
            slots.append(Slot(lambda: Generator(first.gen.model, first.gen.device, weights_of=first.gen, **options),
                              gpu))
        if parallel > 1:
            together = Together(first.submit(Batch, [s.gen.graph for s in slots[:MOST]]).result(), gpu)
            if say:
                say(f"memory: batched steps of {len(together.batch.graphs)} slots {fmt_bytes(together.batch.nbytes)}")
            for slot in slots:
                slot.gen.bursts = together
    except BaseException:
        Engine(slots, together).close()
        raise
    return Engine(slots, together), first.gen.model.path.name


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("serve")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; one beyond this machine needs --api-key.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True, help="Context length of a slot.")
@click.option("--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Slots: sequences kept at once, each with its caches and checkpoints; those decoding step "
                   "together, up to 8 in one batched step (more requests queue for a slot).")
@click.option("--checkpoint-mib", type=click.IntRange(0), default=1024, show_default=True,
              help="Device memory for snapshots of the delta-net state at prompt chunk boundaries, from which a "
                   "prompt that shares only part of the last one resumes (0: only prompts that extend it).")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' (all routes but /health).")
@click.option("--alias", default=None, help="The model's name in /v1/models and replies (default: the file's name).")
@click.option("--reasoning-format", type=click.Choice(REASONING_FORMATS), default="auto", show_default=True,
              help="auto: a reply's thinking as reasoning_content, apart from its content; none: the raw text.")
@click.option("--reasoning-budget", type=click.IntRange(-1), default=-1, show_default=True,
              help="Thinking tokens after which </think> is forced (-1: no limit; 0: no thinking).")
@click.option("--device", "device", default=None, help="Index, name substring or alias (zdsl devices).")
@kv_type_option
@spec_options
def serve(model, host, port, n_ctx, parallel, checkpoint_mib, api_key, alias, reasoning_format, reasoning_budget,
          device, kv, spec, draft_max, draft_model):
    """Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
    /v1/responses, /v1/models, /health, /metrics, /props, /tokenize, /detokenize. A request whose prompt starts with what the slot holds feeds
    only the rest. Ctrl-C (or SIGTERM) finishes the requests under way, then exits."""
    import uvicorn

    if not loopback(host) and not api_key:
        raise ZdslError(f"--host {host} listens beyond this machine: give --api-key KEY too (clients then send it "
                        "as 'Authorization: Bearer KEY')")
    from zdsl.models.qwen35.model.sampler import SamplerConfig
    from zdsl.models.qwen35.model.speculate import speculation

    engine, model_id = open_engine(model, device, n_ctx=n_ctx, kv=kv, checkpoint_mib=checkpoint_mib,
                                   parallel=parallel, say=_say, speculate=speculation(spec, draft_max, SamplerConfig()),
                                   draft_model=draft_model)
    model_id = alias or model_id
    try:
        _say(f"serving {model_id} on http://{host}:{port}/v1 (context {engine.n_ctx} tokens, "
             f"{parallel} slot{'' if parallel == 1 else 's'})")
        with signals_seen() as seen:
            uvicorn.run(app(engine, model_id, api_key, reasoning_format=reasoning_format,
                            reasoning_budget=None if reasoning_budget < 0 else reasoning_budget),
                        host=host, port=port, log_level="warning")
        if seen:
            n = engine.metrics.requests
            _say(f"stopped by {seen[0]} after {n} request{'' if n == 1 else 's'}")
    finally:
        engine.close()


@contextlib.contextmanager
def signals_seen():
    """The SIGINT and SIGTERM that arrive while uvicorn runs, by name. uvicorn drains the server
    on either with its own handlers, then raises the signal again; these handlers take it then,
    so the engine closes and the process exits 0 (SIGTERM's default would kill it with the
    device open, SIGINT's would end in a KeyboardInterrupt)."""
    seen: list[str] = []
    before = {sig: signal.signal(sig, lambda signum, frame: seen.append(signal.Signals(signum).name))
              for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
