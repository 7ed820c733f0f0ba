// Shim: the CPU emulation (kernels/emulation/cuda_emu.h, force-included) defines the cuda_fp16 types.
#pragma once
