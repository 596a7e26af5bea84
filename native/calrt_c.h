/*
 * calrt_c.h — the C ABI calfsm binds (cffi, ABI mode) to reach a CalRT 0.7.6 device.
 *
 * Two libraries implement it:
 *   - libcalrt_emu.so (native/calrt_emu.c): an emulator computing the reference model
 *     (docs/reference-model.md) bit-identically to calfsm's SimDriver, with a device
 *     worker thread, a latency model, finite KV and injectable faults (calrt_emu_*);
 *   - a vendor shim over CalRT 0.7.6 (docs/vendor-shim.md), which implements every
 *     non-emu function and may omit the calrt_emu_* ones.
 *
 * The exact semantics of every call are docs/driver-protocol.md; this header only adds
 * what is specific to C.
 *
 * Conventions
 * -----------
 *  - Every function returns a CalRT code (int32_t, 0 = success, the numbers of
 *    calfsm.errors.CalrtCode) and fills its out-parameters only on success. The one
 *    exception is calrt_abi_version(), which cannot fail.
 *  - Handles are opaque 64-bit values, never pointers: an index into a handle table plus
 *    a generation (a process-wide serial number). 0 is never a valid handle. A handle that
 *    is 0, was destroyed, belongs to another device, or was created before a
 *    configuration/full reset returns CALRT_INVALID_STATE (6); the library never
 *    dereferences a stale handle and never crashes on one. Two exceptions: the status of
 *    an output buffer made stale by a reset stays readable (calrt_get_status: a STALE job
 *    may still complete into it), and calrt_release_buffer accepts stale handles.
 *  - A NULL out-parameter or a NULL string argument returns CALRT_INVALID_VALUE (4).
 *  - A device handle after calrt_device_close() returns CALRT_INVALID_STATE (6) from
 *    every function (closing twice also returns 6 and does nothing else).
 *  - Every function is thread-safe. calrt_wait() blocks only the calling thread; other
 *    threads may submit, query and reset meanwhile.
 *  - Names (models, tensors, CSRs) are NUL-terminated byte strings shorter than
 *    CALRT_NAME_MAX bytes and compared exactly (never by prefix or substring).
 *  - Host memory mapped with calrt_map_buf() is read (inputs) or written (outputs) by the
 *    device when the job executes, on the device's own thread. The caller keeps it
 *    alive and unmoved until calrt_wait() reported the job finished, the buffer was
 *    destroyed, or — after a reset — calrt_pending_jobs() reports 0.
 */
#ifndef CALRT_C_H
#define CALRT_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change of this header. calfsm refuses a library whose
 * calrt_abi_version() differs (calfsm.errors.Incompatible).
 *   1  the single-row ABI
 *   2  batch graphs: calrt_capabilities_t.batch_rows, calrt_set_batch_rows,
 *      calrt_set_kv_seq_row, calrt_set_csr_row, calrt_get_row_status,
 *      calrt_emu_set_batch_row_share, the fault point SET_BATCH_ROWS and the effect
 *      ROW_CCU_EXCEPTION */
#define CALRT_C_ABI_VERSION 2u

#define CALRT_NAME_MAX 256   /* bytes, including the terminating NUL */
#define CALRT_MAX_DIMS 8

/* ---- codes (calfsm.errors.CalrtCode) ------------------------------------------------ */
enum {
    CALRT_SUCCESS = 0,
    CALRT_ALLOC_FAILED = 1,
    CALRT_NOT_FOUND = 3,
    CALRT_INVALID_VALUE = 4,
    CALRT_INVALID_STATE = 6,
    CALRT_ALREADY_CONFIGURED = 7,
    CALRT_FILE_FORMAT_INVALID = 12,
    CALRT_TIMEOUT = 13,
    CALRT_OUT_OF_RANGE = 14,
    CALRT_MISSING_CONFIG = 16,
    CALRT_DEVICE_BUSY = 17,
    CALRT_INVALID_CALBIN = 19,
    CALRT_DTYPE_MISMATCH = 21,
    CALRT_SHAPE_MISMATCH = 22,
    CALRT_UNSUPPORTED = 27,
    CALRT_WRONG_DIRECTION = 29
};

/* ---- enums --------------------------------------------------------------------------- */
enum { CALRT_ENGINE_AUTO = -1, CALRT_ENGINE_PING = 0, CALRT_ENGINE_PONG = 1 };

/* CalrtOutputBuf::GetStatus values (calfsm OutputStatus) */
enum {
    CALRT_STATUS_IDLE = 0,
    CALRT_STATUS_PENDING = 1,
    CALRT_STATUS_DONE_OK = 2,
    CALRT_STATUS_DONE_CCU_EXCEPTION = 3,
    CALRT_STATUS_DONE_ABORTED = 4
};

/* Task kind of a model (calfsm TaskKind); NONE when the graph has no task type tag. */
enum {
    CALRT_KIND_NONE = -1,
    CALRT_KIND_PREFILL_IDS = 0,
    CALRT_KIND_PREFILL_EMBEDS = 1,
    CALRT_KIND_DECODE = 2,
    CALRT_KIND_VISION = 3
};

enum { CALRT_DIR_INPUT = 0, CALRT_DIR_OUTPUT = 1 };

/* Bits of calrt_capabilities_t.resets */
enum { CALRT_RESET_CCU = 1, CALRT_RESET_CONFIGURATION = 2, CALRT_RESET_FULL = 4 };

/* ---- handles (index + generation; 0 = none) ----------------------------------------- */
typedef uint64_t calrt_device_t;  /* a VirtualDevice (and its KvManager) */
typedef uint64_t calrt_model_t;   /* a configured model of the calbin */
typedef uint64_t calrt_buf_t;     /* a CalrtInputBuf or a CalrtOutputBuf */

typedef struct {
    uint32_t resets;              /* CALRT_RESET_* bits */
    int32_t parallel_mode;        /* EnableParallelMode available */
    int32_t fixed_engine_slots;   /* infer_with_fixed_task_type available */
    int32_t engine_slots;         /* 1, or 2 with Ping/Pong */
    int32_t batch_rows;           /* the batch calls (calrt_set_batch_rows, ..._row) work:
                                   * a job of a batch model carries 1..B rows */
} calrt_capabilities_t;

/* Who a job is for (calfsm JobTag); not part of CalRT. */
typedef struct {
    int64_t job_id;
    int64_t seq_id;
    int64_t generation;
} calrt_job_tag_t;

typedef struct {
    char name[CALRT_NAME_MAX];
    int32_t kind;                 /* CALRT_KIND_* */
    int32_t tile_d0;              /* output tile rows from graph metadata; -1 if none */
    uint32_t n_inputs;
    uint32_t n_outputs;
    uint32_t n_csrs;
} calrt_model_info_t;

typedef struct {
    char name[CALRT_NAME_MAX];
    char dtype[8];                /* the DType string: S32 U32 S16 U16 S8 U8 F32 F16 BF16 */
    int32_t direction;            /* CALRT_DIR_* */
    uint32_t ndim;
    int64_t shape[CALRT_MAX_DIMS];
    uint64_t byte_size;
} calrt_tensor_info_t;

/* ---- identity ------------------------------------------------------------------------ */

/* CALRT_C_ABI_VERSION of the library. Cannot fail; callable before anything else. */
uint32_t calrt_abi_version(void);

/* The CalRT runtime version ("0.7.6"), NUL-terminated, into buf[cap].
 * cap too small: CALRT_OUT_OF_RANGE. (CalRT: GetRuntimeVersion) */
int32_t calrt_runtime_version(char *buf, size_t cap);

/* ---- device -------------------------------------------------------------------------- */

/* Open a device (CalRT: VirtualDevice construction + driver open). `options` may be NULL
 * or "" (the emulator ignores unknown options). At most 256 devices open at once
 * (CALRT_ALLOC_FAILED beyond). */
int32_t calrt_device_open(const char *options, calrt_device_t *out);

/* Close the device: pending jobs end DONE_ABORTED and their waiters wake; every later call
 * with this handle returns CALRT_INVALID_STATE. The library stops touching host memory
 * before this returns. (CalRT: VirtualDevice destruction) */
int32_t calrt_device_close(calrt_device_t dev);

/* What the device can do. (CalRT: none; a shim reports what its runner proved.) */
int32_t calrt_get_capabilities(calrt_device_t dev, calrt_capabilities_t *out);

/* ---- configuration ------------------------------------------------------------------- */

/* Load a calbin (CalRT: VirtualDevice::Configure(Calbin)).
 * The emulator takes the calbin *description* in the line format below (what
 * calfsm.drivers.calrt writes from a calfsm Calbin); a vendor shim takes the line
 * `path <percent-encoded file path>` naming the real .calbin (docs/vendor-shim.md).
 *
 *   calfsm-calbin 1                         first line, exactly
 *   sha256 <hex or =>                       optional
 *   calrt_version <version>                 optional
 *   model <name> <kind> <tile_d0>           starts a model; kind is the TaskKind value
 *                                           (prefill_ids, prefill_embeds, decode, vision)
 *                                           or `-`; tile_d0 an integer or `-`
 *   input <name> <dtype> <byte_size> <ndim> <d0> ... <d(ndim-1)>
 *   output <name> <dtype> <byte_size> <ndim> <d0> ...
 *   csr <name>
 *   end                                     last line, exactly
 *
 * Fields are separated by single spaces; each string is percent-encoded (every byte
 * <= 0x20, >= 0x7f, '%' and '=' is written %XX) and the empty string is written `=`.
 * Tensors and CSRs belong to the last `model`. Roles are positional, as calfsm's
 * Calbin.from_manifest writes them: input 0 is the token (or embedding) tensor, input 1
 * the position tensor, output 0 the logits; csr 0 is cur_seq, csr 1 total_seq.
 *
 * A model's batch B (docs/driver-protocol.md, Batches) is the first dimension of its
 * token tensor when that has one ([B, n] ids, [B, n, hidden] embeddings; a tensor of
 * lower rank is one row, B = 1). With B > 1 every tensor of the model is [B, ...] (rank
 * >= 2), and a prefill output holds B x tile_d0 x V elements.
 *
 * Codes: ALREADY_CONFIGURED (7) when configured (until a configuration or full reset);
 * INVALID_CALBIN (19) for zero models or a model the device cannot load (duplicate or
 * empty names, too few tensors or CSRs, a tensor whose byte_size is not its shape, a
 * prefill model without tile_d0 or whose output is not B x tile_d0 x V, a B > 1 model
 * with a tensor that is not [B, ...]); FILE_FORMAT_INVALID (12) when the text does not
 * parse (unknown line, bad number, dtype or kind, name too long, byte_size that is not
 * shape x itemsize, more than CALRT_MAX_DIMS dims). */
int32_t calrt_configure(calrt_device_t dev, const char *calbin, size_t nbytes);

/* Number of configured models (CalRT: Calbin::GetAllModels().size()).
 * Not configured: MISSING_CONFIG. */
int32_t calrt_model_count(calrt_device_t dev, uint32_t *out);

/* The index-th model in calbin order (CalRT: GetAllModels()[index]).
 * index >= count: OUT_OF_RANGE; not configured: MISSING_CONFIG. */
int32_t calrt_model_at(calrt_device_t dev, uint32_t index, calrt_model_t *out);

/* Exact-name lookup (never substring or prefix). No such model: NOT_FOUND; not
 * configured: MISSING_CONFIG. */
int32_t calrt_model_lookup(calrt_device_t dev, const char *exact_name, calrt_model_t *out);

/* Name, kind, tile_d0 and counts of a model (CalRT: Model::GetName, task type, layout
 * metadata). */
int32_t calrt_model_info(calrt_device_t dev, calrt_model_t model, calrt_model_info_t *out);

/* Tensor metadata; index runs over the inputs first, then the outputs
 * (0 <= index < n_inputs + n_outputs, else OUT_OF_RANGE). (CalRT: Model tensor list:
 * GetName, GetShape, GetPrimitiveType, ByteSize) */
int32_t calrt_model_tensor(calrt_device_t dev, calrt_model_t model, uint32_t index,
                           calrt_tensor_info_t *out);

/* The index-th CSR name, NUL-terminated, into buf[cap] (CalRT: the model's CSR table).
 * index out of range or cap too small: OUT_OF_RANGE. */
int32_t calrt_model_csr(calrt_device_t dev, calrt_model_t model, uint32_t index,
                        char *buf, size_t cap);

/* ---- buffers ------------------------------------------------------------------------- */

/* Create an input and an output buffer for `model`, optionally bound to an engine slot
 * (CalRT: CalrtInputBuf/CalrtOutputBuf construction). engine PING/PONG without the
 * fixed_engine_slots capability: UNSUPPORTED; another value: INVALID_VALUE. */
int32_t calrt_create_buffers(calrt_device_t dev, calrt_model_t model, int32_t engine,
                             calrt_buf_t *inp, calrt_buf_t *out);

/* Destroy both (CalRT: buffer destruction). Either one stale or destroyed: INVALID_STATE;
 * inp an output or out an input: WRONG_DIRECTION; a job pending: DEVICE_BUSY and nothing
 * is destroyed. */
int32_t calrt_destroy_buffers(calrt_device_t dev, calrt_buf_t inp, calrt_buf_t out);

/* The owner drops a buffer handle (CalRT: the C++ buffer object's destructor, also for a
 * buffer made stale by a reset, which calrt_destroy_buffers refuses). The handle is
 * invalid afterwards. A job still using the buffer (a STALE job surviving a reset) keeps
 * it alive: then CALRT_DEVICE_BUSY is returned, the buffer is freed when the job ends,
 * and the caller keeps the mapped host memory alive until calrt_pending_jobs() is 0. */
int32_t calrt_release_buffer(calrt_device_t dev, calrt_buf_t buf);

/* Map host memory into a tensor of the buffer (CalRT: MapBuf). Checks in order: unknown
 * tensor NOT_FOUND; an input tensor into an output buffer or the other way
 * WRONG_DIRECTION; `dtype` (the DType string the caller declares for the host memory)
 * not the tensor's DTYPE_MISMATCH; nbytes not the tensor's byte_size SHAPE_MISMATCH;
 * host NULL INVALID_VALUE (calfsm passes NULL for a read-only output array); a job
 * pending on the buffer DEVICE_BUSY. Mapping again replaces the previous mapping (slices
 * stay); mapping an output resets its status to IDLE (never submitted). */
int32_t calrt_map_buf(calrt_device_t dev, calrt_buf_t buf, const char *tensor,
                      void *host, uint64_t nbytes, const char *dtype);

/* Active byte region of a tensor (CalRT: SliceTensor). Unknown tensor: NOT_FOUND; tensor
 * of the other direction: WRONG_DIRECTION; size <= 0, offset < 0 or offset + size >
 * byte_size: OUT_OF_RANGE; not a multiple of the dtype size: INVALID_VALUE; a job
 * pending on the buffer: DEVICE_BUSY. */
int32_t calrt_slice_tensor(calrt_device_t dev, calrt_buf_t buf, const char *tensor,
                           int64_t offset, int64_t size);

/* Make the whole tensor active again (CalRT: SliceTensor(0, ByteSize()), the slice reset).
 * On an unsliced tensor: 0. Pending job: DEVICE_BUSY. */
int32_t calrt_undo_slice(calrt_device_t dev, calrt_buf_t buf, const char *tensor);

/* Set a CSR of an input buffer by exact name (CalRT: SetCsrByName). Name not among the
 * model's CSRs: NOT_FOUND; value outside 0..2^32-1: INVALID_VALUE; an output buffer:
 * WRONG_DIRECTION; pending job: DEVICE_BUSY. */
int32_t calrt_set_csr(calrt_device_t dev, calrt_buf_t inp, const char *name, int64_t value);

/* The KV sequence the job in this input buffer reads and writes (CalRT: the buffer's
 * KvSeqId). seq_id outside 0..2^31-1: INVALID_VALUE; pending job: DEVICE_BUSY. */
int32_t calrt_set_kv_seq(calrt_device_t dev, calrt_buf_t inp, int64_t seq_id);

/* ---- batches (docs/driver-protocol.md, Batches) ---------------------------------------
 * A model whose tensors are [B, ...] with B > 1 runs jobs of 1..B rows, each row with its
 * own KV sequence, CSRs and outcome: row r reads the first cur_seq[r] tokens and
 * positions of row r of the input tensors and writes its logits at [r, ...]. The
 * single-row calls (calrt_set_kv_seq, calrt_set_csr, calrt_get_status for row 0) are
 * row 0. Without the batch_rows capability (a runtime without batch graphs) the three
 * setters return UNSUPPORTED right after the handle and direction checks;
 * calrt_get_row_status always works. */

/* The rows of the job in this input buffer (CalRT: the batch graph's row count): 1 <= rows
 * <= B, else INVALID_VALUE; an output buffer: WRONG_DIRECTION; pending job: DEVICE_BUSY.
 * A new buffer carries 1 row; rows..B-1 are padding (not read, no KV, zero logits).
 * Reaches the fault point SET_BATCH_ROWS (its seq_id: the buffer's row-0 KV sequence). */
int32_t calrt_set_batch_rows(calrt_device_t dev, calrt_buf_t inp, uint32_t rows);

/* calrt_set_kv_seq for row `row` of the buffer (CalRT: the row's KvSeqId as the batch
 * graph names it). The checks of calrt_set_kv_seq come first, then row >= B:
 * INVALID_VALUE; then pending job: DEVICE_BUSY. Reaches the fault point SET_KV_SEQ as
 * calrt_set_kv_seq does (its seq_id: the argument). Row 0 is calrt_set_kv_seq. */
int32_t calrt_set_kv_seq_row(calrt_device_t dev, calrt_buf_t inp, uint32_t row,
                             int64_t seq_id);

/* calrt_set_csr for row `row` of the buffer (CalRT: the row's CSR as the batch graph names
 * it). The checks of calrt_set_csr come first, then row >= B: INVALID_VALUE; then pending
 * job: DEVICE_BUSY. Reaches the fault point SET_CSR as calrt_set_csr does (its seq_id:
 * the buffer's row-0 KV sequence). Row 0 is calrt_set_csr. */
int32_t calrt_set_csr_row(calrt_device_t dev, calrt_buf_t inp, const char *name,
                          uint32_t row, int64_t value);

/* CALRT_STATUS_* of row `row` of the last job of an output buffer (CalRT: the batch
 * graph's per-row outcome, else the job's), after executing every job whose finish time
 * has come: PENDING while the job is pending; after a job that ended other than DONE_OK
 * that status; after DONE_OK, DONE_OK for a row that wrote its logits and KV and
 * DONE_CCU_EXCEPTION for one that failed its checks or a row fault; IDLE for a padding
 * row, a row >= B, or a buffer never submitted (or mapped again since). A B == 1 model:
 * row 0 has the job's status. Returns 0 unless the handle is bad (INVALID_STATE; stale
 * handles stay readable, as for calrt_get_status) or `status` is NULL. */
int32_t calrt_get_row_status(calrt_device_t dev, calrt_buf_t out, uint32_t row,
                             int32_t *status);

/* ---- execution ----------------------------------------------------------------------- */

/* Queue one job (CalRT: calrt::infer). Checks in order: configured (MISSING_CONFIG);
 * handles valid (INVALID_STATE); buffers of `model`, in then out (INVALID_VALUE); every
 * tensor mapped, both CSRs and the KV sequence set, of every row below the buffer's rows
 * (MISSING_CONFIG); two of those rows on one KV sequence, or an input tensor of a B > 1
 * model sliced (INVALID_VALUE); neither buffer pending (DEVICE_BUSY); queue not full
 * (DEVICE_BUSY: one job, or in parallel mode one per engine). Nothing is read from host
 * memory here.
 * `tag` (may be NULL) says who the job is for; only fault rules and traces use it. */
int32_t calrt_infer(calrt_device_t dev, calrt_model_t model, calrt_buf_t inp,
                    calrt_buf_t out, const calrt_job_tag_t *tag);

/* As calrt_infer on a fixed engine slot (CalRT: calrt::infer_with_fixed_task_type, Ping or
 * Pong). Parallel mode off or no capability: UNSUPPORTED; engine not PING/PONG, or buffers
 * bound to the other engine: INVALID_VALUE; that engine busy: DEVICE_BUSY. */
int32_t calrt_infer_fixed(calrt_device_t dev, calrt_model_t model, calrt_buf_t inp,
                          calrt_buf_t out, int32_t engine, const calrt_job_tag_t *tag);

/* Wait for the job of an output buffer (CalRT: CalrtOutputBuf::Wait(timeout)).
 * timeout_ns < 0 waits forever. Not an output buffer, or never submitted: INVALID_STATE.
 * Finished (also DONE_CCU_EXCEPTION or DONE_ABORTED): 0. Not finished within the
 * timeout: TIMEOUT and the job stays pending. */
int32_t calrt_wait(calrt_device_t dev, calrt_buf_t out, int64_t timeout_ns);

/* CALRT_STATUS_* of an output buffer (CalRT: CalrtOutputBuf::GetStatus), after executing
 * every job whose finish time has come. Works on stale handles too. */
int32_t calrt_get_status(calrt_device_t dev, calrt_buf_t out, int32_t *status);

/* Bytes the device produced for an output tensor in the last finished job (CalRT: the
 * output tensor's ByteSize() after the job). No finished job: INVALID_STATE. */
int32_t calrt_output_bytes(calrt_device_t dev, calrt_buf_t out, const char *tensor,
                           uint64_t *nbytes);

/* Jobs submitted and not yet finished or aborted, including orphans of a reset that
 * still write their (old) output buffer (stale completion). 0 means the device touches
 * no host memory. (CalRT: no direct call; a shim counts its own submissions.) */
int32_t calrt_pending_jobs(calrt_device_t dev, uint32_t *out);

/* ---- KV manager (CalRT: VirtualDevice::GetKvManager()) ------------------------------- */

/* *ok = at least n positions free (CalRT: KvManager::canAllocate). */
int32_t calrt_kv_can_allocate(calrt_device_t dev, uint64_t n, int32_t *ok);

/* *ok = the sequence's allocation grew to target_len positions, or already had it
 * (CalRT: KvManager::Apply). Not enough free: *ok = 0, nothing changes. */
int32_t calrt_kv_apply(calrt_device_t dev, int64_t seq_id, uint64_t target_len, int32_t *ok);

/* Shrink to keep_len positions, forgetting KV words >= keep_len (CalRT:
 * KvManager::Release). Unknown sequence: 0. */
int32_t calrt_kv_release(calrt_device_t dev, int64_t seq_id, uint64_t keep_len);

/* ---- device control ------------------------------------------------------------------ */

/* Every reset kind turns parallel mode off (the host enables it again).
 * CalRT: VirtualDevice::ResetCCU — pending jobs end DONE_ABORTED; configuration and KV
 * stay. */
int32_t calrt_reset_ccu(calrt_device_t dev);
/* CalRT: VirtualDevice::ResetConfiguration — as ResetCCU, and the configuration is
 * dropped: models and buffers become stale (INVALID_STATE). KV stays. */
int32_t calrt_reset_configuration(calrt_device_t dev);
/* CalRT: VirtualDevice::Reset — as ResetConfiguration, and all KV is cleared. */
int32_t calrt_reset(calrt_device_t dev);

/* CalRT: VirtualDevice::EnableParallelMode(on). No capability: UNSUPPORTED; a job
 * pending: DEVICE_BUSY. */
int32_t calrt_enable_parallel_mode(calrt_device_t dev, int32_t on);

/* ---- emulator control (libcalrt_emu only; a vendor shim may omit these) --------------- */

/* Device time source. REAL (default): CLOCK_MONOTONIC, jobs finish on their own.
 * VIRTUAL: device time moves only through calrt_wait (to a job's finish or by its timeout)
 * and calrt_emu_advance, and a job whose finish time has come executes at the next
 * calrt_wait/calrt_get_status/calrt_output_bytes/calrt_infer, exactly like calfsm's
 * SimDriver on a VirtualClock. Switching needs an idle device (else DEVICE_BUSY). */
enum { CALRT_EMU_CLOCK_REAL = 0, CALRT_EMU_CLOCK_VIRTUAL = 1 };
int32_t calrt_emu_set_clock(calrt_device_t dev, int32_t mode);
/* VIRTUAL: the device time in ns, and moving it forward (never back). */
int32_t calrt_emu_now(calrt_device_t dev, int64_t *now_ns);
int32_t calrt_emu_advance(calrt_device_t dev, int64_t ns);
/* VIRTUAL: set the device time to t_ns if that is later (following an outside clock). */
int32_t calrt_emu_advance_to(calrt_device_t dev, int64_t t_ns);

/* Latency model (all >= 0; default all zero): H2D seconds per byte, compute seconds per
 * token (prefill) and per step (decode), D2H seconds per byte; jitter in [0, 1] scales the
 * stages of job k (1, 2, ...) by 1 + jitter (2 u / 2^32 - 1), u = fmix32(seed ^ k
 * 0x9E3779B1), as calfsm's LatencyModel does. */
int32_t calrt_emu_set_latency(calrt_device_t dev, double h2d_s_per_byte,
                              double prefill_s_per_token, double decode_s_per_step,
                              double d2h_s_per_byte, double jitter, uint32_t seed);

/* Transfer share in [0, 1) (default 0; else INVALID_VALUE): of a job's time as the
 * latency model gives it (H2D + compute + D2H), this fraction is spent in transfers, half
 * H2D and half D2H, the rest in compute (calfsm LatencyModel.transfer_share). */
int32_t calrt_emu_set_transfer_share(calrt_device_t dev, double share);

/* Batch row share in [0, 1) (default 0; else INVALID_VALUE): a decode job of `rows` rows
 * computes decode_s_per_step x (1 + share x (rows - 1)); a prefill job of a batch model
 * computes prefill_s_per_token x the tokens (cur_seq) of all its rows, and its H2D moves
 * each row's cur_seq tokens and positions (calfsm LatencyModel.batch_row_share). */
int32_t calrt_emu_set_batch_row_share(calrt_device_t dev, double share);

/* Shape cost (calfsm LatencyModel.shape_cost and context_token_s; docs/driver-protocol.md,
 * Timing). graph 0 (the default) models a dynamic-shape device: a step costs the rows it
 * carries, a decode row adds context_s_per_token x its total_seq. graph 1 models a static
 * calbin: a step costs its model's whole batch, padded rows included (a prefill: every
 * row as long as its longest; a decode: the batch row share over all of them), each
 * decode row attending over the whole context window (the configuration's max_seq).
 * graph other than 0 or 1, or context_s_per_token not a finite number >= 0:
 * INVALID_VALUE. */
int32_t calrt_emu_set_shape_cost(calrt_device_t dev, int32_t graph,
                                 double context_s_per_token);

/* Phase timeline (docs/driver-protocol.md, Timeline): the device keeps the last `jobs`
 * jobs that ended (executed or aborted; default 256, 0 keeps none, at most 2^20, else
 * INVALID_VALUE), each with the planned start and end of its H2D, compute and D2H in
 * device-time ns (NEVER = INT64_MAX for a compute that never ends) and when it ended (its
 * finish, or the reset or close that aborted it). Setting it clears what was kept. */
typedef struct {
    uint64_t job;                 /* the device's job number, 1, 2, ... */
    int32_t engine;               /* CALRT_ENGINE_PING / PONG (serial mode: PING) */
    int32_t status;               /* CALRT_STATUS_* it ended with */
    int32_t has_tag;
    calrt_job_tag_t tag;
    int64_t phase_ns[6];          /* H2D start, end; compute start, end; D2H start, end */
    int64_t ended_ns;
} calrt_emu_job_record_t;
int32_t calrt_emu_set_timeline(calrt_device_t dev, uint32_t jobs);
/* The records kept, oldest first, then one per job still pending (status PENDING, its
 * planned phases, ended_ns NEVER) in submission order: the last `cap` of those into out[],
 * *n = how many were written. Jobs whose finish time has come are executed first. */
int32_t calrt_emu_timeline(calrt_device_t dev, calrt_emu_job_record_t *out, uint32_t cap,
                           uint32_t *n);

/* KV capacity in token positions (default 1 << 20); below what is allocated:
 * INVALID_VALUE. */
int32_t calrt_emu_set_kv_capacity(calrt_device_t dev, uint64_t positions);

/* Advertised capabilities (e.g. to emulate a device without ping/pong, or one whose
 * runtime has no batch calls: batch_rows = 0). */
int32_t calrt_emu_set_capabilities(calrt_device_t dev, const calrt_capabilities_t *caps);

/* Fault rules: calfsm.drivers.faults.FaultRule pushed down, matched with the same counting
 * rules (see that module): a call *reaches* its point when every argument check passed
 * (kv_can_allocate/kv_apply: the honest answer is true; wait: the job is still pending);
 * each rule whose filter matches advances its match ordinal; the first rule (in the order
 * added) that fires at that ordinal decides the call:
 *   CODE     the call returns `code` and changes nothing (wait: device time does not move)
 *   REFUSE   kv_can_allocate/kv_apply report *ok = 0
 *   job effects, at INFER (the submit succeeds and returns 0):
 *   CCU_EXCEPTION  the job ends DONE_CCU_EXCEPTION and writes nothing although Wait succeeds
 *   SHORT_OUTPUT   only n_bytes bytes of the output are written (n_bytes < 0: half the
 *                  tensor) and output_bytes reports that
 *   NAN / INF      BF16 NaN 0x7FC0 / +Inf 0x7F80 at element `index` of the row holding
 *                  the last token's logits
 *   HANG           the job never finishes until a reset aborts it
 *   STALE          a reset does not abort the job: it finishes at its time anyway, writes
 *                  its old output array, but no KV
 *   ROW_CCU_EXCEPTION  a batch job runs, but the row whose KV sequence the rule's seq_id
 *                  names (row 0 without one; none if no row is on it) ends
 *                  DONE_CCU_EXCEPTION in calrt_get_row_status and writes nothing; on a
 *                  B == 1 model it is CCU_EXCEPTION
 * On a job of a B > 1 model NAN / INF go into the row whose KV sequence the rule's seq_id
 * names (row 0 without one; no row when the rule matched the tag's sequence and no row is
 * on it); the other effects hit the whole job.
 * Filters (which point has which: calfsm.drivers.faults.FAULT_POINTS): seq_id (>= 0; at
 * infer the tag's seq_id, else the input buffer's KV sequence, and on a B > 1 model also
 * the KV sequence of any row below the buffer's rows; at wait and output_bytes the
 * KV sequence of the buffer's last job; the seq argument of kv_apply, kv_release and
 * set_kv_seq (also calrt_set_kv_seq_row); at the other buffer calls, set_batch_rows
 * included, the input buffer's row-0 KV sequence at that moment),
 * job_id (has_job_id; the tag's job_id at infer, wait and output_bytes), name (has_name;
 * the CSR, tensor or model name). The rule fires at match ordinals nth, nth + every, ...
 * (every = 0: only nth), at most `limit` times (< 0: unlimited). */
enum {
    CALRT_EMU_POINT_CONFIGURE = 0,
    CALRT_EMU_POINT_CREATE_BUFFERS = 1,
    CALRT_EMU_POINT_MAP_BUFFER = 2,
    CALRT_EMU_POINT_SLICE_TENSOR = 3,
    CALRT_EMU_POINT_SET_CSR = 4,
    CALRT_EMU_POINT_SET_KV_SEQ = 5,
    CALRT_EMU_POINT_INFER = 6,            /* calrt_infer and calrt_infer_fixed */
    CALRT_EMU_POINT_WAIT = 7,
    CALRT_EMU_POINT_KV_CAN_ALLOCATE = 8,
    CALRT_EMU_POINT_KV_APPLY = 9,
    CALRT_EMU_POINT_RESET = 10,           /* any of the three resets */
    CALRT_EMU_POINT_ENABLE_PARALLEL_MODE = 11,
    CALRT_EMU_POINT_GET_ALL_MODELS = 12,  /* calrt_model_count */
    CALRT_EMU_POINT_MODEL = 13,           /* calrt_model_lookup */
    CALRT_EMU_POINT_DESTROY_BUFFERS = 14,
    CALRT_EMU_POINT_UNDO_SLICE = 15,
    CALRT_EMU_POINT_OUTPUT_BYTES = 16,
    CALRT_EMU_POINT_KV_RELEASE = 17,
    CALRT_EMU_POINT_SET_BATCH_ROWS = 18,
    CALRT_EMU_POINT_COUNT = 19
};
enum {
    CALRT_EMU_EFFECT_CODE = 0,
    CALRT_EMU_EFFECT_REFUSE = 1,
    CALRT_EMU_EFFECT_CCU_EXCEPTION = 2,
    CALRT_EMU_EFFECT_SHORT_OUTPUT = 3,
    CALRT_EMU_EFFECT_NAN = 4,
    CALRT_EMU_EFFECT_INF = 5,
    CALRT_EMU_EFFECT_HANG = 6,
    CALRT_EMU_EFFECT_STALE = 7,
    CALRT_EMU_EFFECT_ROW_CCU_EXCEPTION = 8
};
typedef struct {
    int32_t point;                /* CALRT_EMU_POINT_* */
    int32_t effect;               /* CALRT_EMU_EFFECT_* valid at that point */
    int64_t nth;                  /* >= 1 */
    int64_t every;                /* 0: none */
    int64_t limit;                /* < 0: unlimited */
    int64_t seq_id;               /* < 0: no filter */
    int32_t has_job_id;
    int64_t job_id;
    int32_t has_name;
    char name[CALRT_NAME_MAX];
    int32_t code;                 /* CODE: the code returned (non-zero) */
    int64_t n_bytes;              /* SHORT_OUTPUT; < 0: half the tensor */
    int64_t index;                /* NAN/INF element index in the row */
} calrt_emu_rule_t;

/* Append a rule (at most 1024). Bad point/effect pair, nth < 1, every < 0 or CODE with
 * code 0: INVALID_VALUE. */
int32_t calrt_emu_add_rule(calrt_device_t dev, const calrt_emu_rule_t *rule);

/* Drop every rule and its counters. */
int32_t calrt_emu_clear_rules(calrt_device_t dev);

/* Counters for tests: jobs executed, aborted, and turned into ghosts (STALE jobs that
 * survived a reset), since open. */
int32_t calrt_emu_stats(calrt_device_t dev, uint64_t *executed, uint64_t *aborted,
                        uint64_t *ghosts);

#ifdef __cplusplus
}
#endif
#endif /* CALRT_C_H */
