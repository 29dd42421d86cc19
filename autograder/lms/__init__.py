"""What a learning management system (Canvas, Moodle, any other) hands over and takes back.

* :mod:`autograder.lms.intake`: an LMS download (zip or folder) turned into one submission per
  student and lab, every file of it accounted for (graded, superseded, refused).
* :mod:`autograder.lms.gradebook`: the LMS's own gradebook file, filled with a lab's points.
* :mod:`autograder.lms.overrides`: an instructor's points per student and test, kept across
  regrades.

Nothing here runs a student's code: it only reads names, file metadata and CSV files, in the
grader's process, before and after grading (the data flows intake → judge → reports).
"""
