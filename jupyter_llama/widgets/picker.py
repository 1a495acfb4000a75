"""``ModelPicker`` (``%llama picker``): choose a model and options, see the scheduler's fit
plan before loading, load, unload, and stream an answer."""

from __future__ import annotations

import asyncio

import ipywidgets as W

from ..client import LlamaClient, LlamaError
from .base import _Actions, _descendants, _on_frontend_close, _safe
from .model import (
    CTX_AUTO,
    CTX_SET,
    GPU_AUTO,
    GPU_N,
    GPU_NONE,
    error_text,
    fit_summary,
    initial_model,
    load_options,
    model_rows,
)
from .render import _e, _help, _status, render_fit


class ModelPicker(W.VBox, _Actions):
    """Pick a registry model, see its predicted memory and fit, load/unload it, run a prompt.

    ``client``: a :class:`~jupyter_llama.client.LlamaClient` (default: found from the
    environment). ``background``: run actions as tasks on the running event loop (the
    default when there is one, as in a Jupyter kernel) or synchronously (``False``).
    """

    def __init__(self, client: LlamaClient | None = None, *, background: bool | None = None,
                 num_predict: int = 256, **kwargs):
        self.client = client if client is not None else LlamaClient()
        self._init_actions(background)
        self._estimate_seq = 0
        self._devices: dict | None = None
        self.updates = 0  # answer updates in the latest run (tests read it)
        self.last_summary: dict | None = None
        self.last_response: dict | None = None
        self._run_task = None

        wide_label = {"description_width": "initial"}
        self.model_select = W.Dropdown(description="model", options=[], layout=W.Layout(width="auto", flex="1"))
        self.refresh_button = W.Button(icon="refresh", tooltip="reload the model list", layout=W.Layout(width="36px"))
        # Context: "automatic" (num_ctx unset: the manager's choice, which the estimate then
        # names) or a size in tokens; the size field shows only when one is set, so no bare 0
        # ever stands for "automatic". Setting ctx_input to a size (as code may) chooses it.
        self.ctx_select = W.Dropdown(description="context",
                                     options=[("automatic", CTX_AUTO), ("set a size", CTX_SET)], value=CTX_AUTO,
                                     tooltip="num_ctx: automatic lets the manager choose (the estimate below "
                                             "says what it chose)", layout=W.Layout(width="200px"))
        self.ctx_input = W.BoundedIntText(value=0, min=0, max=1 << 22, step=512, description="tokens",
                                          continuous_update=False, tooltip="num_ctx: the context size in tokens",
                                          style=wide_label, layout=W.Layout(width="150px", display="none"))
        self.ctx_note = W.HTML()  # what "automatic" came to, once an estimate says
        self.gpu_select = W.Dropdown(description="GPU layers",
                                     options=[("automatic", GPU_AUTO), ("0 (CPU only)", GPU_NONE),
                                              ("set a number", GPU_N)],
                                     value=GPU_AUTO, layout=W.Layout(width="230px"))
        self.gpu_layers_input = W.BoundedIntText(value=0, min=0, max=100000, description="layers on the GPU",
                                                 continuous_update=False,
                                                 tooltip="num_gpu: how many of the model's layers go on the GPU",
                                                 style=wide_label, layout=W.Layout(width="190px", display="none"))
        self.keep_alive_input = W.Text(value="", description="keep alive", placeholder="default (e.g. 5m, -1, 0)",
                                       continuous_update=False, layout=W.Layout(width="240px"))
        self.load_button = W.Button(description="Load", icon="upload", button_style="primary")
        self.unload_button = W.Button(description="Unload", icon="eject")
        self.status_html = W.HTML()
        self.estimate_html = W.HTML()
        self.prompt_input = W.Textarea(placeholder="prompt", layout=W.Layout(width="100%", height="80px"))
        self.num_predict_input = W.BoundedIntText(value=num_predict, min=-1, max=1 << 20, description="max tokens",
                                                  tooltip="num_predict; -1 = until the model stops",
                                                  layout=W.Layout(width="190px"))
        self.run_button = W.Button(description="Run", icon="play", button_style="success")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.answer_html = W.HTML()

        self.refresh_button.on_click(lambda _b: self.refresh_models())
        self.load_button.on_click(lambda _b: self.load())
        self.unload_button.on_click(lambda _b: self.unload())
        self.run_button.on_click(lambda _b: self.run())
        self.stop_button.on_click(lambda _b: self.stop())
        self.model_select.observe(self._on_change, names="value")
        self.ctx_select.observe(self._on_ctx_mode, names="value")
        self.ctx_input.observe(self._on_ctx_size, names="value")
        self.gpu_select.observe(self._on_gpu_mode, names="value")
        self.gpu_layers_input.observe(self._on_gpu_layers, names="value")

        children = [
            W.HBox([self.model_select, self.refresh_button]),
            W.HBox([self.ctx_select, self.ctx_input, self.ctx_note, self.gpu_select, self.gpu_layers_input,
                    self.keep_alive_input], layout=W.Layout(flex_flow="row wrap", align_items="center")),
            W.HBox([self.load_button, self.unload_button, self.status_html], layout=W.Layout(align_items="center")),
            self.estimate_html,
            self.prompt_input,
            W.HBox([self.run_button, self.stop_button, self.num_predict_input]),
            self.answer_html,
        ]
        super().__init__(children=children, **kwargs)
        _on_frontend_close(self, self._cancel_tasks)
        self.refresh_models()

    # ------------------------------------------------------------------ state

    @property
    def selected(self) -> str | None:
        return self.model_select.value or None

    @property
    def options(self) -> dict:
        """The load options the fields describe (Ollama ``options``)."""
        num_ctx = self.ctx_input.value if self.ctx_select.value == CTX_SET else None
        return load_options(num_ctx, self.gpu_select.value, self.gpu_layers_input.value)

    @property
    def keep_alive(self) -> str | None:
        text = self.keep_alive_input.value.strip()
        return text or None

    @property
    def answer(self) -> str:
        """The text of the latest answer."""
        return self._answer_text

    _answer_text = ""

    def _show_error(self, exc: BaseException) -> None:
        self.status_html.value = _status(error_text(exc), error=True)

    def _set_status(self, text: str) -> None:
        self.status_html.value = _status(text)

    # ------------------------------------------------------------------ models

    @_safe
    def refresh_models(self):
        """Reload the model list (tags, and ps for which are loaded)."""
        async def act(ac):
            self._apply_models(await ac.tags(), await ac.ps())

        return self._dispatch(act)

    def _apply_models(self, tags: dict, ps: dict, reestimate: bool = False) -> None:
        rows = model_rows(tags, ps)
        before = self.model_select.value
        names = [r["name"] for r in rows]
        self._quiet = True  # setting options resets the value: no estimate for that
        try:
            self.model_select.options = [(r["label"], r["name"]) for r in rows]
            if before in names:
                self.model_select.value = before
            elif names:  # opening (or the chosen model went away): the one in use, if any
                self.model_select.value = initial_model(tags, ps)
        finally:
            self._quiet = False
        if not rows:
            self.estimate_html.value = _help("No models in the registry yet: pull one with "
                                             "`%llama pull <url or hf.co/owner/repo>`.")
        elif reestimate or self.model_select.value != before or self.last_summary is None:
            self.update_estimate()

    # ------------------------------------------------------------------ estimate

    _quiet = False

    def _on_change(self, change) -> None:
        if not self._quiet:
            self.update_estimate()

    def _on_ctx_mode(self, change) -> None:
        setting = change["new"] == CTX_SET
        self.ctx_input.layout.display = None if setting else "none"
        if setting and not self.ctx_input.value:
            # start from what "automatic" came to for this model, else a common size
            known = (self.last_summary or {}).get("n_ctx")
            self._quiet = True
            try:
                self.ctx_input.value = int(known or 4096)
            finally:
                self._quiet = False
        self._show_ctx_note()
        if not self._quiet:
            self.update_estimate()

    def _on_ctx_size(self, change) -> None:
        if self._quiet:
            return
        mode = CTX_SET if change["new"] else CTX_AUTO  # 0 means "no size": automatic
        if self.ctx_select.value != mode:
            self.ctx_select.value = mode  # (its observer estimates)
        else:
            self.update_estimate()

    def _show_ctx_note(self) -> None:
        n_ctx = (self.last_summary or {}).get("n_ctx")
        auto = self.ctx_select.value == CTX_AUTO
        self.ctx_note.value = _status(f"(comes to {n_ctx} tokens)") if auto and n_ctx else ""

    def _on_gpu_mode(self, change) -> None:
        self.gpu_layers_input.layout.display = None if change["new"] == GPU_N else "none"
        if not self._quiet:
            self.update_estimate()

    def _on_gpu_layers(self, change) -> None:
        if self._quiet:
            return
        if self.gpu_select.value != GPU_N:
            self.gpu_select.value = GPU_N  # a number given is a number chosen (its observer estimates)
        else:
            self.update_estimate()

    @_safe
    def update_estimate(self):
        """Predict the memory of the selected model with the chosen options, before loading."""
        name = self.selected
        if not name:
            return None
        self._estimate_seq += 1
        seq, opts = self._estimate_seq, self.options
        self.estimate_html.value = _status(f"estimating {name} …")
        self.ctx_note.value = ""  # (the new estimate says what automatic comes to)

        async def act(ac):
            self._apply_estimate(seq, await ac.estimate(name, opts), await ac.devices())

        return self._dispatch(act)

    def _apply_estimate(self, seq: int, estimate: dict, devices: dict) -> None:
        if seq != self._estimate_seq:  # a newer selection superseded this one
            return
        self._devices = devices
        summary = fit_summary(estimate, devices)
        self.last_summary = summary
        self.estimate_html.value = render_fit(summary)
        self._show_ctx_note()

    # ------------------------------------------------------------------ load / unload

    @_safe
    def load(self):
        """Load the selected model with the chosen options and keep-alive."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        opts, ka = self.options, self.keep_alive
        self._set_status(f"loading {name} …")
        self.load_button.disabled = True

        def done(res: dict) -> None:
            secs = (res or {}).get("load_duration")
            self._set_status(f"{name} loaded" + (f" in {secs / 1e9:.2f}s" if secs else ""))

        async def act(ac):
            try:
                done(await ac.load(name, options=opts, keep_alive=ka))
            finally:
                self.load_button.disabled = False
            self._apply_models(await ac.tags(), await ac.ps(), reestimate=True)

        return self._dispatch(act)

    @_safe
    def unload(self):
        """Unload the selected model."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        self._set_status(f"unloading {name} …")

        async def act(ac):
            await ac.unload(name)
            self._set_status(f"{name} unloaded")
            self._apply_models(await ac.tags(), await ac.ps(), reestimate=True)

        return self._dispatch(act)

    # ------------------------------------------------------------------ run

    def _render_answer(self, final: dict | None = None) -> None:
        text = f"<pre style='white-space:pre-wrap;margin:4px 0;font-size:13px'>{_e(self._answer_text)}</pre>"
        if final:
            n = final.get("eval_count")
            dur = final.get("eval_duration")
            stats = [f"done ({final.get('done_reason') or 'stop'})"]
            if n:
                stats.append(f"{n} tokens")
                if dur:
                    stats.append(f"{n / (dur / 1e9):.1f} tokens/s")
            if final.get("load_duration"):
                stats.append(f"load {final['load_duration'] / 1e9:.2f}s")
            text += _status(" · ".join(stats))
        self.answer_html.value = text

    def _on_chunk(self, chunk: dict) -> None:
        piece = chunk.get("response") or ""
        if piece:
            self._answer_text += piece
            self.updates += 1
        if chunk.get("done"):
            self.last_response = chunk
            self._render_answer(chunk)
        elif piece:
            self._render_answer()

    def _run_started(self, name: str) -> None:
        self._answer_text = ""
        self.updates = 0
        self.last_response = None
        self.answer_html.value = _status(f"{name} is thinking …")
        self.run_button.disabled = True
        self.stop_button.disabled = False

    def _run_ended(self) -> None:
        if not self._answer_text and self.last_response is None:
            self.answer_html.value = ""  # failed before any text: the status line says why
        self.run_button.disabled = False
        self.stop_button.disabled = True
        self._run_task = None

    @_safe
    def run(self, prompt: str | None = None):
        """Stream the answer to the prompt (the text area's, or ``prompt``) into the widget."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        if prompt is not None:
            self.prompt_input.value = prompt
        text = self.prompt_input.value
        opts = dict(self.options)
        if self.num_predict_input.value:
            opts["num_predict"] = int(self.num_predict_input.value)
        ka = self.keep_alive
        self._run_started(name)

        async def act(ac):
            try:
                stream = ac.generate(name, text, stream=True, options=opts, keep_alive=ka)
                try:
                    async for chunk in stream:
                        self._on_chunk(chunk)
                finally:
                    await stream.aclose()
                self._apply_models(await ac.tags(), await ac.ps())
            except asyncio.CancelledError:
                self._render_answer()
                self._set_status("stopped")
                raise
            finally:
                self._run_ended()

        task = self._dispatch(act)
        if isinstance(task, asyncio.Task):
            self._run_task = task
        return task

    def stop(self) -> None:
        """Stop a generation running in the background (closing the stream stops it on the server)."""
        if self._run_task is not None and not self._run_task.done():
            self._run_task.get_loop().call_soon_threadsafe(self._run_task.cancel)

    _run_task: asyncio.Task | None = None

    def close(self) -> None:
        self._cancel_tasks()
        for w in _descendants(self):
            w.close()
        super().close()
