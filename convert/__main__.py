"""`python convert ...` from a checkout: the same as the `jaxpaged-convert` console script (Hugging
Face safetensors -> jaxpaged's Orbax checkpoint). The converter lives in the package, so that
installing jaxpaged adds no top-level module named `convert`:

- `jaxpaged.checkpoint.convert.convert_checkpoint`: writes `params/` (Orbax), the configs, the
  tokenizer files and a `jaxpaged_format.json` marker; `jaxpaged.checkpoint.loader.load_params`
  reads either form (`jaxpaged.checkpoint.hf_keys` maps every HF tensor to its parameter).
- `jaxpaged.entrypoints.convert_cli`: the command line.
"""

import sys

from jaxpaged.entrypoints.convert_cli import main

if __name__ == "__main__":
    sys.exit(main())
