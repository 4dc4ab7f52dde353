// matmul.cu: IN PROGRESS
extern "C" __global__ void matmul_placeholder() {}
