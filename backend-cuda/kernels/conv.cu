// conv.cu: IN PROGRESS
extern "C" __global__ void conv_placeholder() {}
