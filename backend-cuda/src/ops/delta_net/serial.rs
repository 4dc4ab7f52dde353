//! gated_delta_net's token-serial kernels (`kernels/delta_net.cu`): a pre-pass writes k, q (times
//! scale) and k . q per token as padded f32 rows to scratch, then one kernel runs the recurrence
//! with each state column held in registers (read and written once, in place in its slot);
//! prefills of 128-key heads stage 16-token tiles of k and q in shared memory with cp.async,
//! double buffered.

use tessera_graph::BackendError;
use tessera_ops::TensorMeta;

use super::{Call, Plan, SHORT};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, config};

const PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_prep");
const GDN_N1: Kernel = Kernel::new(Module::DeltaNet, "gdn_n1");
const GDN_N2: Kernel = Kernel::new(Module::DeltaNet, "gdn_n2");
const GDN_N4: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4");
const GDN_N8: Kernel = Kernel::new(Module::DeltaNet, "gdn_n8");
const GDN_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4_vec");
const GDN_TILED_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_tiled_n4_vec");

/// GDN_WARPS * 32 and GDN_COLS in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;

/// Float4 chunks per lane (the kernels' NC): the key dimension padded to 32 NC.
fn chunks(s_k: usize) -> usize {
    s_k.div_ceil(32).next_power_of_two().max(1)
}

/// gdn_prep's rows (one per token, key head and outer index) and their padded length.
fn prep_rows(q: &TensorMeta) -> (usize, usize) {
    let [s_k, h_k, n_t, n_outer] = q.ne;
    (h_k * n_t * n_outer, 32 * chunks(s_k))
}

/// Bytes of gdn_prep's buffers: k and q rows and k . q for every token, 4 (2 KS + 1) bytes per
/// row, rounded up to 256.
pub(super) fn prep_bytes(q: &TensorMeta) -> usize {
    let (rows, ks) = prep_rows(q);
    (4 * rows * (2 * ks + 1)).next_multiple_of(256)
}

/// The serial kernels of one call: every sequence (dense, or ragged without the chunked kernels),
/// or the short ones of a ragged call whose long ones the chunked kernels ran; the work list at
/// `table` (ragged; 0 dense).
pub(super) fn run(cx: &mut Cx<'_>, c: &Call<'_>, plan: &Plan, table: u64) -> Result<(), BackendError> {
    let [q, k, v, g, beta, state, slots] = c.args;
    let [qdt, kdt, vdt, gdt, bdt] = c.dts;
    let (p, offsets, out, err, code, h_k, grouped) = (c.p, c.offsets, c.out, c.err, c.code, c.h_k, c.grouped);
    let qm = &c.metas[0];
    let s_k = k.ne[0] as usize;
    let (s_v, h_v, n_t, n_seq) = (v.ne[0], v.ne[1], v.ne[2], slots.ne[0] as usize);
    // The serial kernels: every sequence (dense, or ragged without the chunked kernels), or the
    // short ones of a ragged call whose long ones the chunked kernels ran.
    let serial_max = if plan.chunked.is_some() { SHORT } else { i64::MAX };
    let (rows, ks) = prep_rows(qm);
    let kbuf = cx.scratch + plan.prep as u64;
    let (qbuf, kq) = (kbuf + (4 * rows * ks) as u64, kbuf + (8 * rows * ks) as u64);
    let ks_len = ks as i32;
    let mut a = cx.kernel(PREP)?;
    a.arg(&q).arg(&qdt).arg(&k).arg(&kdt).arg(&p.scale).arg(&ks_len).arg(&kbuf).arg(&qbuf).arg(&kq);
    let (n_slots, check_here) = (state.ne[3], i32::from(plan.chunked.is_none()));
    a.arg(&offsets).arg(&serial_max).arg(&out).arg(&slots).arg(&n_slots).arg(&SHORT).arg(&table).arg(&check_here);
    a.arg(&err).arg(&code);
    let warps_per_block = THREADS as usize / 32;
    let cfg = config((rows.div_ceil(warps_per_block).clamp(1, 1 << 20) as u32, 1, 1), (THREADS, 1, 1), 0);
    // SAFETY: `gdn_prep(q, qdt, k, kdt, scale, ks_len, kbuf, qbuf, kq, offsets, serial_max, out,
    // slots, n_slots, list_min, table, check, err, op)`: with `check`, block 0 runs the slot check
    // as `check` below describes it (reads the slots and offsets, writes the error record and the
    // work list);
    // q and k are [S_k, H_k, n_t, n_outer] (shape rules), read within those extents; scratch holds
    // (scratch_bytes, Plan::prep) rows = H_k n_t n_outer rows of ks_len floats for kbuf and for
    // qbuf, then rows floats for kq; offsets (null dense) are read clamped to 0..=n_t; ragged, it
    // zeroes the rows of padding tokens of `out`, the op's contiguous f32 [S_v, H_v, n_t, 1]
    // output (grid-stride, within its n_t rows).
    unsafe { a.launch(cfg) }?;

    let aligned = state.data.is_multiple_of(16) && state.nb[0] == 4 && state.nb[1..].iter().all(|b| b % 16 == 0);
    // Prefill of the model head size: tiles of 16 tokens staged in shared memory (double
    // buffered). Ragged: only for sequences longer than SHORT, the plain kernel taking the rest.
    let tiled = n_t > 1 && s_k == 128 && aligned && kbuf.is_multiple_of(16) && serial_max > SHORT;
    let plain = match chunks(s_k) {
        1 => GDN_N1,
        2 => GDN_N2,
        4 if s_k == 128 && aligned => GDN_N4_VEC,
        4 => GDN_N4,
        _ => GDN_N8,
    };
    // (kernel, sequence lengths it takes, blocks in z, work list): the tiled kernel takes a ragged
    // call's long sequences through the work list, the plain one every sequence up to its length.
    let launches: &[(Kernel, i64, i64, usize, u64)] = match (tiled, plan.ragged) {
        (false, _) => &[(plain, 1, serial_max, n_seq, 0)],
        (true, false) => &[(GDN_TILED_N4_VEC, 1, i64::MAX, n_seq, 0)],
        (true, true) => &[(plain, 1, SHORT, n_seq, 0), (GDN_TILED_N4_VEC, SHORT + 1, i64::MAX, plan.n_long, table)],
    };
    for &(kernel, len_min, len_max, blocks_z, list) in launches.iter().filter(|l| l.3 > 0) {
        let grid = ((s_v as usize).div_ceil(COLS) as u32, h_v as u32, blocks_z as u32);
        let mut a = cx.kernel(kernel)?;
        a.arg(&out).arg(&v).arg(&vdt).arg(&g).arg(&gdt).arg(&beta).arg(&bdt).arg(&state).arg(&slots);
        a.arg(&h_k).arg(&grouped).arg(&kbuf).arg(&qbuf).arg(&kq).arg(&offsets);
        let shared = if kernel == GDN_TILED_N4_VEC {
            a.arg(&list);
            let tile_tokens = 64 / chunks(s_k);
            (2 * 4 * (2 * tile_tokens * 128 + tile_tokens * COLS + 3 * tile_tokens)) as u32
        } else {
            0
        };
        a.arg(&len_min).arg(&len_max).arg(&err);
        // SAFETY: `gdn_*(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq,
        // offsets, [table,] len_min, len_max, err)` (the tiled kernel takes the work list). The shape
        // rules give v and out [S_v, H_v, n_t, n_outer], g, beta [1, H_v, n_t, n_outer], state
        // [S_k, S_v, H_v, n_slots], slots [n_seq] and offsets [n_seq + 1] (null dense); the grid
        // covers (S_v / 16, H_v, sequences: n_seq, or the bound on the work list's long ones, blocks
        // past its count returning) and every access is guarded by those extents (ragged token
        // ranges clamped to 0..=n_t); slots outside [0, n_slots) are skipped; S_k <= 32 NC = ks
        // (chosen above) and the prep rows read are those gdn_prep wrote (the same length filter:
        // serial_max >= len_max); the vector kernels run only on a 16-byte aligned state with
        // S_k = 128. The tiled kernel stages 64 / NC tokens per buffer from 16-byte aligned prep
        // buffers (checked above) into two buffers of the shared memory given here; its work
        // list is gdn_check_slots' (in the scratch), null dense.
        unsafe { a.launch(config(grid, (THREADS, 1, 1), shared)) }?;
    }
    Ok(())
}
