"""jupyter-llama: Ollama's manager layer over llama.cpp's llama-server, inside Jupyter."""

from ._version import __version__

__all__ = ["__version__", "LlamaClient", "AsyncLlamaClient"]


def __getattr__(name: str):
    """``from jupyter_llama import LlamaClient``: the client, imported when first asked for
    (importing the package stays cheap: Jupyter imports it to find the extension)."""
    if name in ("LlamaClient", "AsyncLlamaClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'jupyter_llama' has no attribute {name!r}")


def _jupyter_server_extension_points():
    """The Jupyter server extension (imported lazily: the core does not need Jupyter)."""
    from .server.app import LlamaExtension

    return [{"module": "jupyter_llama.server.app", "app": LlamaExtension}]


def _jupyter_labextension_paths():
    """The prebuilt JupyterLab panel (for `jupyter labextension develop` and discovery)."""
    return [{"src": "labextension", "dest": "jupyter-llama"}]


def load_ipython_extension(ipython):
    """``%load_ext jupyter_llama``: registers the ``%llama`` magic."""
    from .magics import load_ipython_extension as load

    load(ipython)
