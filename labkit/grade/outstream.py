"""The sandboxed kernel's stdout and stderr: ipykernel's, sent in pieces of at most ``CHUNK``.

ipykernel sends whatever a cell printed in each 0.2 s as one message. A cell printing in a loop
would make messages of hundreds of MiB, which the grader refuses to receive (``execute``'s
``MAX_MESSAGE``): the flood would go uncounted and the kernel's output channel dropped. Sent in
pieces, every byte reaches the grader, which counts them and stops the notebook at its output
limit (``guard``). The kernel loads this class at start (``--IPKernelApp.outstream_class``),
before any student code; a notebook that replaces it only loses its own output.
"""

from __future__ import annotations

from ipykernel.iostream import OutStream

CHUNK = 1 << 20


class ChunkedOutStream(OutStream):
    def _flush_buffers(self):
        for parent, data in super()._flush_buffers():
            for start in range(0, max(len(data), 1), CHUNK):
                yield parent, data[start:start + CHUNK]
