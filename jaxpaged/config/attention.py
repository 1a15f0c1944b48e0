"""The implementations of paged attention the model can run (`attention_backend`).

"auto" is the Pallas kernels on a GPU and the jnp reference elsewhere; "pallas" on a CPU runs
the kernels in interpret mode. Each name but "auto" is an implementation registered in
`jaxpaged.model.attention` (`BACKENDS`).
"""

ATTENTION_BACKENDS = ("auto", "reference", "pallas")
