"""Documented dense bf16 peak FLOP/s per device, for model FLOPs utilisation (``raytpu.worker.flops``).

Dense figures: NVIDIA's datasheets print "with sparsity" numbers twice the dense ones, halved here.
A run in fp16 has the same peak on these GPUs; a run in fp32 is still measured against the bf16
peak (its MFU is honestly low). Sources:

* TPU, per chip (one device per chip under PJRT, megacore on v4 / v5p): cloud.google.com/tpu/docs
  pages v4 (275 TFLOPs), v5e (197), v5p (459) and v6e (918), "Peak compute per chip (bf16)".
* A100 (SXM and PCIe) 312: NVIDIA A100 datasheet. H100 SXM 989 (1,979 sparse), H100 PCIe 756
  (1,513 sparse), H100 NVL 835 (1,671 sparse): NVIDIA H100 datasheet. H200 SXM 989, H200 NVL
  835: NVIDIA H200 datasheet. L4 121 (242 sparse): NVIDIA L4 datasheet. A10G 70 (140 sparse):
  the NVIDIA A10G datasheet on AWS (the plain A10's 125 does not apply).
"""

from __future__ import annotations

import re

#: TPU generation (as spelt in pod types, v5e as v5e) -> bf16 FLOP/s per chip
TPU_PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}

#: GPU name pattern (matched against ``torch.cuda.get_device_name``, lower case) -> dense bf16
#: FLOP/s; the first match wins, so variants come before their family
GPU_PEAK_FLOPS = [
    (r"\bh100\b.*\bpcie\b", 756e12),
    (r"\bh[12]00\b.*\bnvl\b", 835e12),
    (r"\bh[12]00\b", 989e12),
    (r"\ba100\b", 312e12),
    (r"\ba10g\b", 70e12),
    (r"\bl4\b", 121e12),
]

# device kinds and pod types: "TPU v5 lite", "v5litepod-8", "TPU v6 lite", "v6e-8", "TPU v4", "v5p-16"
_TPU_ALIASES = {"v5lite": "v5e", "v6lite": "v6e", "v5": "v5p"}


def tpu_generation(name: str) -> str:
    """``v4``, ``v5e``, ``v5p`` or ``v6e`` (or the unknown name, normalised) from an accelerator type
    (``v5litepod-8``) or a PJRT device kind (``TPU v5 lite``)."""
    key = re.sub(r"^tpu[\s_-]*", "", name.strip().lower())
    key = re.sub(r"-\d+$", "", key)
    key = re.sub(r"[\s_]", "", key).removesuffix("pod")
    return _TPU_ALIASES.get(key, key)


def tpu_peak_flops(name: str) -> float | None:
    """bf16 peak FLOP/s of one chip of the TPU ``name`` (see :func:`tpu_generation`), None if unknown."""
    return TPU_PEAK_FLOPS.get(tpu_generation(name))


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU ``name`` (``NVIDIA H100 80GB HBM3``), None if unknown."""
    lowered = name.lower()
    return next((peak for pattern, peak in GPU_PEAK_FLOPS if re.search(pattern, lowered)), None)
