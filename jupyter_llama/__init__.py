"""jupyter-llama: Ollama's manager layer over llama.cpp's llama-server, inside Jupyter."""

__version__ = "0.1.0"
