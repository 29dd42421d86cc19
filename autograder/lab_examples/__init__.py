"""The example submissions, one module per lab, named after the lab (``lab01_basics.py`` ...),
each with ``EXAMPLES: dict[str, Edit]`` (student name -> edit of the released notebook) and
maybe a ``TOUR``; ``common.py`` holds what they are made from and ``hostile.py`` the hostile
parts that fit any lab. ``autograder/make_examples.py`` collects them; their expected grades
are in ``autograder/examples/expected-<lab>.csv``."""
