"""The library's version, in a module of its own: the package's ``__init__`` exports it, and
the checkpointer writes it into every checkpoint's metadata. Reading it from the package
itself would make the checkpointer import the package that imports the checkpointer (a
circle of imports). Keep it equal to ``version`` in ``pyproject.toml``."""

__version__ = "0.1.0"
