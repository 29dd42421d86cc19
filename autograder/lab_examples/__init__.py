"""The example submissions of labs 2-6: one module per lab, named after the lab
(``lab02_save_policy.py``), each with ``EXAMPLES: dict[str, Edit]`` (student name -> edit of the
released notebook). ``autograder/make_examples.py`` collects them; their expected grades are in
``autograder/examples/expected-<lab>.csv``."""
