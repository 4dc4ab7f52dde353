//! gated_delta_net's chunked form on tensor cores (`kernels/delta_net_chunked.cu`): `gdn_cw_prep`
//! builds every 64-token chunk's W, U, masked Q K^T and decays in parallel, then `gdn_cw_scan*`
//! runs the chunks in order over column blocks of the state, writing the outputs (on Hopper's
//! sm_90a target `gdn_cw_scan_wg*`, the same pass on warpgroup products).

use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use super::{Call, Plan};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config};

const CW_PREP: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_prep");
const CW_PREP_VEC: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_prep_vec");
const CW_SCAN: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan");
const CW_SCAN4: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan4");
const CW_SCAN_WG: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan_wg");
const CW_SCAN_WG32: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan_wg32");
/// CW_C and CW_D in delta_net_chunked.cu: the chunked kernels' chunk length and head size (S_k = S_v).
pub(super) const CW_C: usize = 64;
pub(super) const CW_D: usize = 128;
/// CW_PREP_SHARED: gdn_cw_prep's k and q rows (padded to 136), A and T (padded to 72), the
/// solve's partial products and three per-token vectors (two blocks per SM).
const CW_PREP_SHARED: u32 = (4 * (2 * CW_C * (CW_D + 8) + 2 * CW_C * (CW_C + 8) + 3 * 256 + 3 * CW_C)) as u32;
/// CW_STAGE_BYTES: both in-order passes' staging of a chunk's A tiles: W and Q (32 tiles of 1 KiB
/// each), two buffers of K^T (32 tiles) and of P (10 tiles), and two chunks' decays.
const SCAN_STAGE_BYTES: usize = 1024 * (32 + 32 + 2 * 32 + 2 * 10) + 4 * 2 * 2 * CW_C;

/// gdn_cw_scan's shared memory for NT column tiles a block (8 NT state columns): the staging, then
/// S, V_new and scaled V_new of the block's columns as pre-split B tiles (213 KiB at NT = 8, 185 at
/// NT = 4: one block per SM).
pub(super) const fn scan_shared(nt: usize) -> u32 {
    (SCAN_STAGE_BYTES + 512 * nt * (8 + 4 + 4)) as u32
}

/// CW_WG_SHARED(NC): gdn_cw_scan_wg*'s S, V_new and scaled V_new tiles (hi and lo bf16, NC
/// columns), the staging, and 1 KiB to align the tiles to 1024 bytes (214 KiB at NC = 64, 185 at
/// 32).
const fn wg_shared(nc: usize) -> u32 {
    (1024 + 4 * (CW_D * nc + 2 * CW_C * nc) + SCAN_STAGE_BYTES) as u32
}

/// The in-order pass's kernel, its grid's column blocks, threads a block and shared memory. The
/// columns a block are the mma.sync kernels' choice ([`scan_tiles`]: 64, or 32 where that grid
/// fits one wave); where the module runs its sm_90a path, the wgmma kernel of the same columns
/// runs them (`gdn_cw_scan_wg`, `gdn_cw_scan_wg32`), unless `TESSERA_GDN_SCAN=0` asks for the
/// mma.sync kernels (to measure one against the other).
fn scan_kernel(cx: &mut Cx<'_>, heads_x_seqs: usize) -> (Kernel, usize, u32, u32) {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let nt = scan_tiles(heads_x_seqs, cx.info.multiprocessors);
    let (nc, col_blocks) = (8 * nt, CW_D / (8 * nt));
    let wg = crate::launch::env_number(&SET, "TESSERA_GDN_SCAN") != Some(0)
        && cx.kernels.arch_specific_for(Module::DeltaNetChunked)
        && cx.info.max_shared_per_block >= wg_shared(nc) as usize;
    if wg {
        return (if nc == 32 { CW_SCAN_WG32 } else { CW_SCAN_WG }, col_blocks, 256, wg_shared(nc));
    }
    (if nt == 4 { CW_SCAN4 } else { CW_SCAN }, col_blocks, 64 * nt as u32, scan_shared(nt))
}

/// gdn_cw_scan's column tiles a block: 4 (`gdn_cw_scan4`: S_v / 32 blocks a head and sequence,
/// each with a quarter of the state columns but the whole per-chunk loads) where that grid still
/// fits one wave (a 32-head prefill: 128 blocks, where NT = 8 left half of 132 multiprocessors
/// idle), else 8 (`gdn_cw_scan`; a second wave would cost more than the idle ones).
fn scan_tiles(heads_x_seqs: usize, multiprocessors: usize) -> usize {
    if (CW_D / 32) * heads_x_seqs <= multiprocessors { 4 } else { 8 }
}

/// The chunked kernels' scratch for `n_chunks` chunks, as byte offsets: per (chunk, value head) W
/// and P as pre-split A tiles (32 and 16 KiB), U (32 KiB) and the decays (512 B); per (chunk, key
/// head) Q and K^T as pre-split A tiles (32 KiB each).
pub(super) struct ChunkScratch {
    wf: usize,
    pf: usize,
    uf: usize,
    gm: usize,
    qf: usize,
    ktf: usize,
    pub(super) end: usize,
}

impl ChunkScratch {
    pub(super) fn new(q: &TensorMeta, v: &TensorMeta, n_chunks: usize) -> Self {
        let (vch, kch) = (v.ne[1] * n_chunks, q.ne[1] * n_chunks);
        let wf = 0;
        let pf = wf + vch * 32768;
        let uf = pf + vch * 16384;
        let gm = uf + vch * 32768;
        let qf = gm + vch * 512;
        let ktf = qf + kch * 32768;
        ChunkScratch { wf, pf, uf, gm, qf, ktf, end: ktf + kch * 32768 }
    }
}

/// True when a q, k or v argument is f32 with 16-byte aligned rows of contiguous floats.
fn f32_rows(t: &TensorArg, meta: &TensorMeta) -> bool {
    meta.dtype == DType::F32 && t.nb[0] == 4 && t.data.is_multiple_of(16) && t.nb[1..].iter().all(|b| b % 16 == 0)
}

/// The chunked kernels of one call: `gdn_cw_prep` over every chunk, then the in-order pass, with
/// the buffers and grid of `chunk` ([`Plan::chunked`]) and the work list at `table` (ragged; 0
/// dense).
pub(super) fn run(
    cx: &mut Cx<'_>,
    c: &Call<'_>,
    plan: &Plan,
    chunk: &(ChunkScratch, usize, usize),
    table: u64,
) -> Result<(), BackendError> {
    let [q, k, v, g, beta, state, slots] = c.args;
    let [qdt, kdt, vdt, gdt, bdt] = c.dts;
    let (p, metas, offsets, out, err, h_k, grouped) = (c.p, c.metas, c.offsets, c.out, c.err, c.h_k, c.grouped);
    let h_v = v.ne[1];
    let (sc, n_chunks, n_long) = chunk;
    let at = |off: usize| cx.scratch + off as u64;
    let (wf, pf, uf, gm, qf, ktf) = (at(sc.wf), at(sc.pf), at(sc.uf), at(sc.gm), at(sc.qf), at(sc.ktf));
    let vec = [(q, 0), (k, 1), (v, 2)].iter().all(|(t, i)| f32_rows(t, &metas[*i]));
    let prep = if vec { CW_PREP_VEC } else { CW_PREP };
    cx.allow_shared(prep, CW_PREP_SHARED)?;
    let mut a = cx.kernel(prep)?;
    a.arg(&q).arg(&qdt).arg(&k).arg(&kdt).arg(&v).arg(&vdt).arg(&g).arg(&gdt).arg(&beta).arg(&bdt).arg(&p.scale);
    a.arg(&h_k).arg(&grouped).arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&offsets).arg(&table);
    a.arg(&err);
    // Dense: (H_v, chunks of a sequence, sequences); ragged: (H_v, the chunk bound, 1).
    let grid = if plan.ragged {
        (h_v as u32, *n_chunks as u32, 1)
    } else {
        (h_v as u32, (*n_chunks / plan.n_seq) as u32, plan.n_seq as u32)
    };
    // SAFETY: `gdn_cw_prep*(q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, scale, h_k, grouped, wf,
    // pf, uf, gm, qf, ktf, offsets, table, err)`: S_k = S_v = 128 (Plan::new); q, k, v, g and
    // beta are read within their shape-rule extents (tokens past a chunk's sequence are not
    // read; ragged offsets are clamped to 0..=n_tokens); the vector kernel runs only on f32 q,
    // k and v with 16-byte aligned rows of contiguous floats (f32_rows); each block writes only
    // the entries of its chunk gc < n_chunks (dense: the grid's; ragged: the work list's,
    // whose total is at most the bound n_chunks the buffers are sized for, blocks past it
    // return) in the ChunkScratch buffers, sized for n_chunks (scratch_bytes) and 256-byte
    // aligned (checked above); the work list is gdn_check_slots' (in the scratch, after the
    // buffers), null dense; the dynamic shared memory is CW_PREP_SHARED, allowed above.
    unsafe { a.launch(config(grid, (256, 1, 1), CW_PREP_SHARED)) }?;

    let (scan, col_blocks, threads, shared) = scan_kernel(cx, h_v as usize * *n_long);
    cx.allow_shared(scan, shared)?;
    let mut a = cx.kernel(scan)?;
    a.arg(&out).arg(&state).arg(&slots).arg(&h_k).arg(&grouped);
    a.arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&offsets).arg(&table).arg(&err);
    let grid = (col_blocks as u32, h_v as u32, *n_long as u32);
    // SAFETY: `gdn_cw_scan{,4,_wg}(out, state, slots, h_k, grouped, wf, pf, uf, gm, qf, ktf,
    // offsets, table, err)`: out is [128, H_v, n_t, n_outer] and state [128, 128, H_v,
    // n_slots] (shape rules); the grid covers (column blocks, H_v, sequences: dense all,
    // ragged the bound on the work list's long ones, blocks past its count return), each block
    // 128 / col_blocks columns with the threads scan_kernel gives; slots outside [0, n_slots)
    // are skipped and outputs past a sequence's tokens not written; the chunk buffers are those
    // gdn_cw_prep filled for every chunk of the block's sequence, 16-byte aligned for its
    // cp.async copies; the dynamic shared memory is scan_kernel's, allowed just above (the wg
    // kernel runs only where its module was compiled for sm_90a).
    unsafe { a.launch(config(grid, (threads, 1, 1), shared)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn scan_shared_memory_is_what_the_kernels_lay_out() {
        // gdn_cw_scan{,4}: 152576 bytes of staging and 32 NT B tiles of 512 bytes; the wg
        // kernels: 1 KiB of alignment and NC-column hi / lo tiles of S, V_new and scaled V_new.
        assert_eq!(super::scan_shared(8), 152576 + 65536);
        assert_eq!(super::scan_shared(4), 152576 + 32768);
        assert_eq!(super::wg_shared(64), 1024 + 65536 + 152576);
        assert_eq!(super::wg_shared(32), 1024 + 32768 + 152576);
    }

    #[test]
    fn scan_blocks_halve_where_the_grid_fits_a_wave() {
        assert_eq!(super::scan_tiles(32, 132), 4); // 128 blocks of 32 columns
        assert_eq!(super::scan_tiles(33, 132), 4); // 132 blocks
        assert_eq!(super::scan_tiles(34, 132), 8);
        assert_eq!(super::scan_tiles(48, 132), 8); // 96 blocks of 64 columns, not 192
    }
}
