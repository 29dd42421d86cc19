"""nbgrader configuration for plain ``nbgrader`` commands, run from the repository root:

    nbgrader generate_assignment lab01_basics --force --config autograder/nbgrader_config.py

The build (``python -m autograder.build``) and the grader (``autograder/grade.sh``) use the
same settings (autograder/settings.py) with their own work folders.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autograder.settings import configure

configure(get_config())  # noqa: F821  (get_config is provided by traitlets when it loads this file)
