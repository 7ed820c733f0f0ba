"""Bugs planted into copies of the kernel sources, to prove the harness catches them.

Each entry removes or changes exactly one line of a .cu file; ``apply`` fails loudly if the line
is no longer there (the kernel changed: update the entry, do not drop the test).
"""

from __future__ import annotations

PLANTED_BUGS: dict[str, tuple[str, str, str]] = {
    # The barrier between writing the query into shared memory and reading it back: without it
    # warps read q_smem while other threads still write it (ThreadSanitizer: data race).
    "missing_sync": (
        "paged_attention.cu",
        "  __syncthreads();  // q_smem is complete\n",
        "\n",
    ),
    # The last partition reads one token past the context: with a full last block-table row the
    # block number comes from one entry past the row (AddressSanitizer: heap-buffer-overflow past
    # the block tables), otherwise from a slot nobody wrote (NaN poison in the output).
    "read_past_context": (
        "paged_attention.cu",
        "const int end = start + PARTITION_SIZE < context_len ? start + PARTITION_SIZE : context_len;",
        "const int end = start + PARTITION_SIZE < context_len + 1 ? start + PARTITION_SIZE : context_len + 1;",
    ),
}


def apply(bug: str, source: str, code: str) -> str:
    """``code`` of kernels/``source`` with ``bug`` planted (unchanged if the bug is in another file)."""
    file, old, new = PLANTED_BUGS[bug]
    if file != source:
        return code
    count = code.count(old)
    if count != 1:
        raise AssertionError(f"planted bug {bug!r}: expected the line once in {file}, found it {count} times")
    return code.replace(old, new)
