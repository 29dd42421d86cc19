"""The judge: where every graded point of a test cell is decided (issue 47).

What runs where:

* **The judge's process** (trusted, outside the sandbox, the full minickpt): the lab's setup
  cell and every test cell, visible, hidden and grader check alike, in their source's words
  (:mod:`.cells`). The student's task functions are bound there to proxies.
* **The student's worker** (in the submission's sandbox, the graded build): the student's task
  cells' imports and definitions, and nothing else; it runs a function only when a proxy calls
  it, with the arguments the test chose (:mod:`.worker`).
* **Between them** (:mod:`.wire`): plain data (numbers, strings, arrays, pytrees of known
  classes, exceptions of known classes) crosses by value; any other object (a file system, a
  writer, a callback) stays on its side and the other side gets a handle whose public methods
  it may call. Nothing is pickled; nothing the worker says is a verdict.

A test passes when its code ran to its end in the judge. The kernel run is feedback only.
"""
