// Shim: the CPU emulation (kernels/emulation/cuda_emu.h, force-included) defines the cuda_bf16 types.
#pragma once
