"""A localhost OpenAI-compatible chat server that answers as vLLM 0.33 does, built from vLLM's own code.

It runs under the vLLM 0.33.0 venv's interpreter (`tests/peers.py`), and uses vLLM's own
pieces where they run on a CPU:

* requests are validated by `ChatCompletionRequest` (vllm/entrypoints/openai/chat_completion/
  protocol.py), whose validator renames a message's `reasoning_content` to `reasoning`;
* the prompt is the tokenizer's chat template (a real tokenizer directory, e.g. the Kimi one)
  with the request's `chat_template_kwargs`, and is checked by `TokenizeParams` built by
  `ChatCompletionRequest.build_tok_params` (vllm/renderers/params.py: the context-length 400
  "This model's maximum context length is ..."), `max_tokens` clamped by
  vllm/entrypoints/serve/utils/api_utils.py::get_max_tokens;
* errors are `create_error_response` (vllm/entrypoints/serve/exception_handling/error_response.py);
* with a reasoning parser (`kimi_k2`, from vLLM's registry) the output is detokenised with its
  special tokens, as vLLM's parser engine asks (vllm/parser/engine/parser_engine.py), and split by
  the parser's `extract_reasoning`; without one `skip_special_tokens` merges thinking and answer;
* responses are `ChatCompletionResponse` objects; `reasoning_field: "reasoning_content"` renames
  the field as SGLang (and vLLM before 0.33) name it.

Only the model is scripted (a GPU's job): the generated text is a deterministic function of the
rendered prompt, the last user message and the seed, tokenised by the real tokenizer:
`<reasoning></think><answer>` when the generation prompt opens a think block, else `<answer>`,
cut at `max_tokens` (`finish_reason: "length"`).

Spec (a JSON file, the first argument): `tokenizer` (a directory), `model` (served name),
`max_model_len`, `reasoning_parser` (null or a vLLM parser name), `reasoning_field`, `latency_s`
(the time from a request's arrival to its reply), `gather_in_flight` (N > 0: the first requests are
held until N are in flight at once, at most 60 s: a client's concurrency shown without a race),
`refuse_parameter` (a request field answered with a 400 naming it, as a server that does not support
it), `answer_words` (filler words).
`POST /control` changes spec fields, zeroes the counts (`reset_stats`), or with `down_s` closes the
port for that long and reopens it (a server restart; it answers once the port is closed);
`GET /stats` gives request counts and the most requests ever in flight. The project side starts it
with `VLLMLikeServer` (`wait_up` waits for a restarted server to answer again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace


def serve(spec_path: str) -> None:
    from pydantic import ValidationError
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError

    spec = json.loads(Path(spec_path).read_text())
    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    from vllm.reasoning import ReasoningParserManager

    state = SimpleNamespace(
        spec=spec,
        requests=0,
        completed=0,
        in_flight=0,
        max_in_flight=0,
        down_s=0.0,
        lock=threading.Condition(),
        gathered=False,
        httpd=None,
    )

    def error(exc) -> tuple[int, dict]:
        response = create_error_response(exc)
        return response.error.code, response.model_dump(mode="json")

    def complete(body: dict) -> tuple[int, dict]:
        if spec.get("refuse_parameter") and spec["refuse_parameter"] in body:
            name = spec["refuse_parameter"]
            return error(
                VLLMValidationError(f"Unsupported request parameter: {name}", parameter=name, value=body[name])
            )
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            return error(VLLMValidationError(str(e).splitlines()[0]))
        kwargs = request.chat_template_kwargs or {}
        prompt = tok.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        try:
            request.build_tok_params(SimpleNamespace(max_model_len=spec["max_model_len"]))._token_len_check(tok, ids)
            max_tokens = get_max_tokens(spec["max_model_len"], request.max_tokens, len(ids), {})
        except (VLLMValidationError, ValueError) as e:
            return error(e)
        user = next(m["content"] for m in reversed(request.messages) if m["role"] == "user")
        turn = sum(m["role"] == "assistant" for m in request.messages) + 1
        seed = request.seed if request.temperature else 0
        answer = f"The answer to {user} is {len(ids)}." + " more" * spec.get("answer_words", 0)
        reasoning = f"Turn {turn}: the user asks {user}; seed {seed}."
        thinking = prompt.endswith("<think>")  # the generation prompt opened a think block
        generated = tok((reasoning + "</think>" + answer) if thinking else answer, add_special_tokens=False)[
            "input_ids"
        ]
        finish = "length" if len(generated) > max_tokens else "stop"
        generated = generated[:max_tokens]
        if spec.get("reasoning_parser"):
            parser_cls = ReasoningParserManager.get_reasoning_parser(spec["reasoning_parser"])
            text = tok.decode(generated, skip_special_tokens=False)
            reasoning_text, content = parser_cls(tok, chat_template_kwargs=kwargs).extract_reasoning(text, request)
        else:
            reasoning_text, content = None, tok.decode(generated, skip_special_tokens=True)
        response = ChatCompletionResponse(
            model=request.model,
            choices=[
                ChatCompletionResponseChoice(
                    index=0,
                    message=ChatMessage(role="assistant", content=content, reasoning=reasoning_text),
                    finish_reason=finish,
                )
            ],
            usage=UsageInfo(
                prompt_tokens=len(ids), completion_tokens=len(generated), total_tokens=len(ids) + len(generated)
            ),
        )
        out = response.model_dump(mode="json")
        if spec.get("reasoning_field", "reasoning") != "reasoning":
            message = out["choices"][0]["message"]
            message[spec["reasoning_field"]] = message.pop("reasoning", None)
        return 200, out

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": spec["model"], "object": "model"}]})
            elif self.path == "/stats":
                self._send(
                    200,
                    {
                        "requests": state.requests,
                        "completed": state.completed,
                        "max_in_flight": state.max_in_flight,
                        "cpu_s": time.process_time(),
                    },
                )
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            arrived = time.monotonic()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/control":
                down = body.pop("down_s", 0)
                if body.pop("reset_stats", False):
                    state.requests = state.completed = state.max_in_flight = 0
                    state.gathered = False
                spec.update(body)
                if down:  # the reply leaves once the port refuses connections: the caller knows the server is down
                    state.down_s = down
                    state.httpd.shutdown()
                    state.httpd.server_close()
                self._send(200, {"ok": True})
                return
            with state.lock:
                state.requests += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                gather = spec.get("gather_in_flight") or 0
                if gather and not state.gathered:  # held until `gather` requests are in flight together, once
                    state.lock.wait_for(lambda: state.in_flight >= gather or state.gathered, timeout=60)
                    state.gathered = True
                    state.lock.notify_all()
            try:
                code, obj = complete(body)
                # the reply leaves latency_s after the request came, its own processing included
                time.sleep(max(0.0, spec.get("latency_s", 0) - (time.monotonic() - arrived)))
            finally:
                with state.lock:
                    state.in_flight -= 1
                    state.completed += 1
            self._send(code, obj)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # hundreds of clients connect at once

    port = spec.get("port", 0)
    while True:
        state.httpd = Server(("127.0.0.1", port), Handler)
        if port == 0:
            port = state.httpd.server_address[1]
            print(f"READY {port}", flush=True)
        state.httpd.serve_forever()
        state.httpd.server_close()  # a restart: the port refuses connections for down_s
        time.sleep(state.down_s)
        state.down_s = 0.0


class VLLMLikeServer:
    """Starts `serve` in a subprocess of `python` (the vLLM venv's); `url`, `control`, `stats`."""

    def __init__(self, python: Path, spec: dict, workdir: Path, startup_timeout: float = 240.0):
        self.spec_path = Path(workdir) / "vllm_like_server.json"
        self.spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false"
        )
        self.proc = subprocess.Popen(
            [str(python), __file__, str(self.spec_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(startup_timeout)
        if not ready or not ready[0].startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"the vLLM-like server did not start: {self.proc.stderr.read()[-3000:]}")
        self.port = int(ready[0].split()[1])
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _call(self, path: str, body: dict | None = None) -> dict:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def control(self, **changes) -> None:
        self._call("/control", changes)

    def stats(self) -> dict:
        return self._call("/stats")

    def wait_up(self, timeout: float = 60.0) -> None:
        """Return once the server answers again after a `down_s` restart."""
        import urllib.error

        deadline = time.monotonic() + timeout
        while True:
            try:
                self.stats()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM-like server did not come back within {timeout:g} s") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1])
