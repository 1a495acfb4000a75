"""jupyter-llama: Ollama's manager layer over llama.cpp's llama-server, inside Jupyter."""

from ._version import __version__

__all__ = ["__version__"]


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
