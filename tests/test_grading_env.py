"""What of the grader's environment reaches a student's kernel."""

from autograder import sandbox


def test_a_kernel_gets_jax_settings_but_never_a_shared_compilation_cache():
    """The test suite shares one JAX compilation cache between its processes; a submission
    that could write there would hand the next submission's tests compiled code of its own."""
    grader = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
              "JAX_COMPILATION_CACHE_DIR": "/srv/cache",
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "HOME": "/root",
              "SECRET_TOKEN": "x"}
    assert sandbox.kernel_env(grader) == {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    unsandboxed = sandbox.without_shared_caches(grader)
    assert "JAX_COMPILATION_CACHE_DIR" not in unsandboxed
    assert not [k for k in unsandboxed if k.startswith("JAX_PERSISTENT_CACHE_")]
    assert unsandboxed["JAX_PLATFORMS"] == "cpu" and unsandboxed["HOME"] == "/root"
