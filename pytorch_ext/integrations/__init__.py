"""attnkit inside other libraries' model code.

- :mod:`attnkit.integrations.transformers` -- an ``"attnkit"`` attention implementation for
  Hugging Face transformers (``register()``, then ``attn_implementation="attnkit"``).

Each integration imports its library only when used: ``import attnkit.integrations.<name>``
works without that library installed; its ``register()`` raises an ImportError that names the
pip extra to install (``pip install "attnkit[transformers]"``).
"""

__all__ = ["transformers"]
