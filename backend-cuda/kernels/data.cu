// data.cu: IN PROGRESS
extern "C" __global__ void data_placeholder() {}
