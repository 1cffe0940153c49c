"""The one typed config tree: model, data, optim, comm, train, checkpoint, launch.

pydantic models with ``extra="forbid"`` so an unknown key is an error that names it. The classes are
built once, here, and never change. What the extensions add is composed when a config is validated,
from the tables of scaleout/section.py (the leaf below this module and the extensions):

* ``model.arch`` is a string checked against :data:`scaleout.section.FAMILIES`; each family with a
  section (``Family.config``, declared in its own folder: scaleout/families/bert/config.py) gets
  its typed ``model.<name>`` (``cfg.model.bert.hidden``); ``data.source`` is one the families read;
* ``comm.algorithm`` is a string checked against :data:`scaleout.section.ALGORITHMS`; the
  ``comm.*`` option keys are each algorithm's ``Options.config_keys`` (scaleout/comm/<name>.py).

The built-in families and algorithms fill those tables when ``scaleout.families`` and
``scaleout.comm`` are imported (torch-free declarations that never import this module): the first
validation imports them (:func:`scaleout.config.compose.declared`), importing this module does not.

Every rule between keys lives here: the section validators, ``Config``'s, and ``Config.check_world``
for those that need the world size. They run in ``scaleout config show`` and in the CLI's preflight
before anything is spawned, and again in every rank.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from scaleout.config.compose import ModelConfig, declared, one_of
from scaleout.env import detection_order
from scaleout.errors import ConfigError, excerpt
from scaleout.section import MAX_WORLD
from scaleout.section import Section as _Section
from scaleout.units import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB

# Upper bounds reject typos (hidden=1e9, num_workers=100000) with one line before anything is
# spawned, instead of an OOM or a fork storm in every rank later. Each is far above anything real:
# the largest published dense models have hidden 18432 (PaLM), 118 layers, vocabularies up to 256k;
# the largest machines ~10^5 accelerators; MLPerf's largest global batches are ~10^4-10^5 samples.
# numpy's legacy seeding and torch's generators both take it; seeds are offset by indices
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer than any job's time limit


class DataConfig(_Section):
    # what some registered family reads (each Family's data_sources; Config checks it is the
    # model.arch family's)
    source: str = "synthetic"
    path: str | None = None
    # Image sets (data.source imagenet/images): folder = <path>/{train,val}/<class>/<image>,
    # shards = <path>/{train,val}-NNNNNN.tar (webdataset layout); auto = shards when
    # <path>/train-000000.tar exists (docs/data-layouts.md).
    format: Literal["auto", "folder", "shards"] = "auto"
    # Keep decoded uint8 images in memory (per process, up to 12 GiB per rank split over its
    # workers, as NVIDIA's DALI_CACHE_SIZE): with shards, each node's share of the set.
    cache_decoded: bool = False
    # Keep this rank's evaluation images on the device after the first evaluation (uint8, after
    # the deterministic resize + centre crop), as NVIDIA's MLPerf ResNet keeps its eval set: later
    # evaluations read and decode nothing. Only while the share fits 1/20 of the device's memory
    # (the host's, split over its local ranks, on CPU); larger shares are read every time.
    cache_eval: bool = True
    max_seq_len: int = Field(512, ge=8, le=1 << 17)
    packing: Literal["none", "spfhp", "lpfhp", "nnlshp", "lphp", "auto"] = "none"
    # The training order: scaleout (every sample once per epoch, seeded (data.seed, epoch); a batch
    # may straddle epochs) or torch (DistributedSampler(seed=data.seed, drop_last=True) with
    # set_epoch + a DataLoader dropping the last partial batch: the plain DDP loop's batches).
    order: Literal["scaleout", "torch"] = "scaleout"
    max_per_pack: int = Field(3, ge=1)
    mask_prob: float = Field(0.15, gt=0.0, lt=1.0)
    # Mask slots per sequence (20 at 128 tokens as in Google's BERT; MLPerf uses 76 at 512).
    max_predictions: int = Field(20, ge=1)
    # Copies of the corpus with different masks (Google's create_pretraining_data uses 10).
    dupe_factor: int = Field(5, ge=1)
    num_workers: int = Field(
        0, ge=0, le=256
    )  # per rank; 256 = the cores of the largest 2-socket nodes
    # How prefetch workers start. forkserver: forked from a clean single-threaded server process,
    # never from the rank, whose gloo/comm/OpenMP threads make fork() unsafe (see
    # scaleout/train/prefetch.py).
    worker_start: Literal["forkserver", "spawn", "fork"] = "forkserver"
    prefetch: int = Field(2, ge=1)
    pin_memory: bool = True  # used only when CUDA is present
    eval_samples: int = Field(256, ge=1, le=1 << 31)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # Images: random-resized-crop minimum area fraction (MLPerf reference 0.08; NVIDIA uses 0.05).
    crop_min_area: float = Field(0.08, gt=0.0, le=1.0)
    # Images: where JPEGs are decoded. cpu: PIL in the workers (reduced-scale decode, uint8 out);
    # gpu: torchvision.io.decode_jpeg(device="cuda"), batched (families/resnet/data/gpu_decode.py);
    # dali: an NVIDIA DALI pipeline replaces the workers for training batches (class folders;
    # nvJPEG "mixed" decode on CUDA, CPU decode otherwise; optional extra scaleout[dali];
    # families/resnet/data/dali.py).
    decode: Literal["cpu", "gpu", "dali"] = "cpu"
    # Write a known data set to data.path on first use (rank 0 writes, the others wait):
    # fashion-mnist = scaleout data prepare-fashion-mnist --out <data.path>.
    prepare: Literal["none", "fashion-mnist"] = "none"

    @field_validator("source")
    @classmethod
    def _read_by_a_family(cls, source: str) -> str:
        families, _ = declared()
        known: list[str] = []
        for _, fam in families.items():
            known += [s for s in fam.data_sources if s not in known]
        if source not in known:
            raise ValueError(f"data.source={source!r}: expected {one_of(known)}")
        return source

    @model_validator(mode="after")
    def _gpu_decode_reads_image_files(self) -> DataConfig:
        if self.decode == "gpu" and self.source not in ("imagenet", "images"):
            raise ValueError(
                f"data.decode=gpu decodes image files: data.source={self.source!r} has none; "
                "expected data.source imagenet or images (or data.decode=cpu)"
            )
        return self

    @model_validator(mode="after")
    def _dali_reads_image_folders(self) -> DataConfig:
        if self.decode != "dali":
            return self
        if self.source not in ("imagenet", "images"):
            raise ValueError(
                f"data.decode=dali decodes image files: data.source={self.source!r} has none; "
                "expected data.source imagenet or images (or data.decode=cpu)"
            )
        if self.format == "shards":
            raise ValueError(
                "data.decode=dali reads the class-folder layout, not data.format=shards; expected "
                "data.format folder or auto (or data.decode=cpu or gpu for shards)"
            )
        if self.cache_decoded:
            raise ValueError(
                "data.cache_decoded=true is a cache of the prefetch workers, which "
                "data.decode=dali replaces; expected data.cache_decoded=false with dali"
            )
        return self


def warmup_end(warmup_steps: int, start_warmup_step: int = 0) -> int:
    """The step at which the warm-up ends: ``warmup_steps``, less NVIDIA's START_WARMUP_STEP
    offset (<= 0: warm-up as if that many steps had passed; their H100 configs ramp over 330 of
    740 steps with WARMUP_STEPS=200330, START_WARMUP_STEP=-200000). The decay needs steps after
    it: ``total_steps`` must be larger (OptimConfig and optim/schedule.py read it here)."""
    return warmup_steps + start_warmup_step


class OptimConfig(_Section):
    name: Literal["lamb", "lars", "adamw", "sgd"] = "lamb"
    lr: float = Field(1e-3, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-6, ge=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    # LARS trust coefficient eta = 0.001 (You et al. 2017; MLPerf ResNet reference).
    eta: float = Field(0.001, gt=0.0)
    bias_correction: bool = True
    trust_clamp: float | None = None
    clip_grad_norm: float | None = Field(None, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)
    power: float = Field(1.0, ge=0.0)
    end_lr: float = Field(0.0, ge=0.0)
    # Polynomial decay counted from the end of warmup (MLPerf ResNet) or from step 0 (MLPerf BERT).
    decay_from: Literal["warmup", "start"] = "warmup"
    # NVIDIA's START_WARMUP_STEP (<= 0): warm-up as if that many steps had passed
    # (optim/schedule.py)
    start_warmup_step: int = Field(0, le=0)
    sharded: bool = False
    # sharded LAMB only: reduce-scatter during backward, all-gather per bucket (apex
    # DistributedFusedLAMB)
    overlap_comm: bool = False
    # sharded LAMB only: over which ranks the state is sharded: world (1/W each) or node (1/ranks
    # per node each, replicated across nodes: NVIDIA's DistributedFusedLAMB)
    shard: Literal["world", "node"] = "world"
    # the learning rate's decay after warm-up: polynomial (power, decay_from; MLPerf BERT and
    # ResNet) or half a cosine (MLPerf llama31_8b's "cosine with linear warmup")
    schedule: Literal["poly", "cosine"] = "poly"

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimConfig:
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"optim.betas[{i}]={b} must be in [0, 1)")
        return self

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> OptimConfig:
        # the schedule's rule (optim/schedule.py WarmupPoly), here so that a bad pair fails in
        # the preflight and in `config show`, not in every rank's optimizer build
        # (the offset of NVIDIA's START_WARMUP_STEP counted: warmup_end)
        end = warmup_end(self.warmup_steps, self.start_warmup_step)
        if self.total_steps is not None and self.total_steps <= end:
            offset = (
                f" + optim.start_warmup_step={self.start_warmup_step}"
                if self.start_warmup_step
                else ""
            )
            raise ValueError(
                f"optim.total_steps={self.total_steps} must be > optim.warmup_steps="
                f"{self.warmup_steps}{offset} (the decay runs after the warm-up)"
            )
        return self

    @model_validator(mode="after")
    def _sharded_keys_need_the_sharded_lamb(self) -> OptimConfig:
        if self.overlap_comm and not self.sharded:
            raise ValueError(
                "optim.overlap_comm=true needs optim.sharded=true (it overlaps the sharded LAMB's "
                "collectives)"
            )
        if self.shard != "world" and not self.sharded:
            raise ValueError(f"optim.shard={self.shard!r} needs optim.sharded=true")
        if self.sharded and self.name not in ("lamb", "adamw"):
            raise ValueError(
                f"optim.sharded=true is implemented for optim.name='lamb' or 'adamw', got "
                f"optim.name={self.name!r}"
            )
        if self.schedule == "cosine" and (self.start_warmup_step or self.decay_from != "warmup"):
            raise ValueError(
                "optim.schedule=cosine decays from the end of warm-up: expected "
                f"optim.decay_from=warmup and optim.start_warmup_step=0, got {self.decay_from!r} "
                f"and {self.start_warmup_step}"
            )
        return self


AUTO = "auto"  # comm.algorithm: chosen on the world by scaleout/parallel/autotune.py


class CommConfig(_Section):
    # A name in scaleout.comm.ALGORITHMS, checked against the registry when validated (so that an
    # algorithm registered after this module was imported is accepted too), or "auto": probed and
    # chosen at start (scaleout/parallel/autotune.py; with it bucket_mb, first_bucket_mb, chunk_mb
    # and compression are chosen too unless the config sets them).
    algorithm: str = "flat"
    bucket_mb: float = Field(DEFAULT_BUCKET_MB, gt=0.0)
    # The first bucket (the last layers' gradients, ready first) closes at this many MiB, so its
    # all-reduce starts while the rest of backward runs: torch DDP's _DEFAULT_FIRST_BUCKET_BYTES
    # (1 MiB, what DistributedDataParallel(model) gets). null, or not below bucket_mb: the first
    # bucket is a bucket_mb one too.
    first_bucket_mb: float | None = Field(DEFAULT_FIRST_BUCKET_MB, gt=0.0)
    # the gradients' wire dtype (none: as they are); code reads it as ``wire_compression``
    compression: Literal["none", "bf16", "fp16"] = "none"
    torus_x: int | None = Field(None, ge=1)  # ranks per torus row; default = ranks per node
    torus_y: int | None = Field(None, ge=1)
    # Pipeline chunk of the row/column all-reduces on gloo, in MiB (chunk_bytes of
    # scaleout.comm.all_reduce); None = the algorithm's default (comm/rowcol.py, 4 MiB).
    chunk_mb: float | None = Field(None, gt=0.0)
    overlap: bool = True
    timeline: str | None = None  # write a Chrome trace of backward/communication here
    # CPU/gloo only: run the compute thread this much nicer than the communication threads
    # (comm.handles.prioritize_communication); 0 = off. Ignored on CUDA.
    comm_nice: int = Field(0, ge=0, le=19)
    # In-network reduction between nodes (SHARP through NCCL CollNet): on NCCL, scaleout.init()
    # sets NCCL_COLLNET_ENABLE=1 (unless the environment sets it) before the first communicator,
    # and `scaleout simulate scale --config` prices the run with it. Needs SHARP-capable
    # InfiniBand switches and the nccl-rdma-sharp plugin; NCCL falls back to its own algorithms
    # where CollNet cannot apply.
    sharp: bool = False

    # The keys above that are options of some algorithms (each algorithm's Options.config_keys).
    ALGORITHM_KEYS: ClassVar[tuple[str, ...]] = ("torus_x", "torus_y", "chunk_mb")

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, name: str) -> str:
        _, algorithms = declared()
        if name != AUTO and name not in algorithms:
            raise ValueError(
                f"comm.algorithm={excerpt(name)}: expected one of "
                f"{', '.join([*algorithms.names(), AUTO])}"
            )
        return name

    @model_validator(mode="after")
    def _options_of_the_algorithm(self) -> CommConfig:
        if self.algorithm == AUTO:  # each key goes to the algorithms that read it
            return self
        _, algorithms = declared()
        reads = algorithms.get(self.algorithm).Options.config_keys
        for key in self.ALGORITHM_KEYS:
            value = getattr(self, key)
            if value is not None and key not in reads:
                users = [n for n, a in algorithms.items() if key in a.Options.config_keys]
                raise ValueError(
                    f"comm.{key}={value} is an option of {', '.join(users)}; "
                    f"comm.algorithm={self.algorithm} does not read it"
                )
        return self

    def options(self, algorithm: str | None = None) -> Any:
        """The ``Options`` of ``algorithm`` (default: ``comm.algorithm``; ``auto``: flat, the
        plan it starts from) as this section sets them."""
        name = algorithm or self.algorithm
        return declared()[1].get("flat" if name == AUTO else name).Options.from_config(self)

    @property
    def auto(self) -> bool:
        return self.algorithm == AUTO

    @property
    def wire_compression(self) -> str | None:
        """``comm.compression`` as the collectives take it: the wire dtype's name, None for
        ``none`` (the one place that maps it)."""
        return None if self.compression == "none" else self.compression


class ProfileConfig(_Section):
    """torch.profiler on a schedule (torch.profiler.schedule): skip ``wait`` steps, trace
    ``warmup`` steps and discard them, record ``active`` steps; ``repeat`` cycles (0 = until the
    run ends)."""

    wait: int = Field(1, ge=0)
    warmup: int = Field(1, ge=0)
    active: int = Field(3, ge=1)
    repeat: int = Field(1, ge=0)
    dir: str | None = None  # default <train.output_dir>/profile
    ranks: list[int] | None = (
        None  # profile only these global ranks (None = every rank, as HTA wants)
    )
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False


class TrainConfig(_Section):
    global_batch: int = Field(32, ge=1, le=1 << 24)
    grad_accum: int = Field(1, ge=1, le=1 << 16)
    max_steps: int = Field(100, ge=1)
    eval_every: int = Field(20, ge=1)
    # First evaluation after this many steps (0: after eval_every), then every eval_every: NVIDIA's
    # EVAL_ITER_START_SAMPLES / global batch.
    eval_start_step: int = Field(0, ge=0)
    target: float | None = Field(None, gt=0.0)  # eval metric to stop at (MLM accuracy / top-1)
    seed: int = Field(1234, ge=0, le=MAX_SEED)
    deterministic: bool = False
    # Autocast dtype of forward + loss; fp32 master weights and optimizer state; fp16 adds dynamic
    # loss scaling (scaleout/train/precision.py).
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    output_dir: str = "runs/latest"
    init_timeout_s: float = Field(
        600.0, gt=0.0, le=MAX_TIMEOUT_S
    )  # collectives before the first step completes
    step_timeout_s: float = Field(
        120.0, gt=0.0, le=MAX_TIMEOUT_S
    )  # collectives after it (torchtitan's two timeouts)
    progress: bool = True
    # Steps left out of the report's "timed" throughput and of breakdown_s (warm-up: allocator,
    # first collectives, lazy init). 0 = time every step. `scaleout sweep` sets it (--warmup).
    timing_skip_steps: int = Field(0, ge=0)
    # The step-time breakdown synchronises the device around each phase: only every timing_every-th
    # timed step is sampled so the others keep the host running ahead
    # (scaleout/telemetry/timers.py).
    timing_every: int = Field(50, ge=1)
    # Stop (status aborted, exit 1) after this many consecutive steps skipped for non-finite
    # gradients: a run that keeps producing NaN/Inf has diverged, and skipping forever only burns
    # the allocation. 0 = never.
    max_consecutive_skips: int = Field(10, ge=0)
    # A rank is a straggler in a phase of a step (data, compute, arrival at the first bucket,
    # optimizer, inter_allreduce through its link rate) when it is the slowest there, at least this
    # many times the median over ranks, and its excess is >= 5 % of the step: report.json and
    # metrics.jsonl name it (rank, node, phase, slowdown) and its node is quarantined. Measured in
    # the step's agreement all-reduce (scaleout/train/skew.py).
    straggler_threshold: float = Field(1.3, gt=1.0, allow_inf_nan=False)
    # Peak FLOP/s per device for the report's MFU; None = identify the GPU part or measure the CPU
    # (scaleout/telemetry/devices.py). Set it for a GPU that is not in the table.
    peak_flops: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # Rank 0 writes <output_dir>/metrics.jsonl always (scaleout/telemetry/metrics.py), one record
    # per log_every steps; csv / tensorboard / wandb are added when listed here. metrics.png (the
    # curves) is drawn at the end of a run of at least 10 records, or of any run with png listed.
    log_every: int = Field(1, ge=1)
    metrics: list[Literal["jsonl", "csv", "tensorboard", "wandb", "png"]] = ["jsonl"]
    profile: ProfileConfig | None = (
        None  # torch.profiler trace (scaleout/telemetry/profiler.py); true = defaults
    )
    # Every this many steps the replicas vote on a checksum of their weights (8 bytes a rank, one
    # small all-reduce; scaleout/train/replicas.py): a silent data corruption is caught there, the
    # run stops (status aborted) and `scaleout slurm run` quarantines the odd rank's node. 0 = at
    # the end of the run only.
    replica_vote_every: int = Field(100, ge=0)

    @field_validator("profile", mode="before")
    @classmethod
    def _profile_flag(cls, v: object) -> object:
        return {} if v is True else None if v is False else v


class CheckpointConfig(_Section):
    """``every_steps``: a save every N steps (0 = only on preemption and at the end), or ``auto``:
    the first after one step, then every Young/Daly interval sqrt(2 x save stall x job MTBF)
    (scaleout.telemetry.report.young_daly_interval_s) in steps of the measured step time,
    re-estimated at
    each save; the job MTBF is ``mtbf_h`` (one node's mean time between failures, hours) / nodes.
    ``async`` (default true): a save copies the state to host memory at the step boundary and a
    background thread writes and commits it (the sharded state through DCP's async_save), so a
    save slower than train.step_timeout_s does not time out the peers; false: rank 0 writes
    while every rank waits (the synchronous path)."""

    model_config = ConfigDict(populate_by_name=True)

    dir: str | None = None
    every_steps: Annotated[int, Field(ge=0)] | Literal["auto"] = 0
    keep: int = Field(2, ge=1)
    resume: bool = True
    async_: bool = Field(True, alias="async")
    # a node's MTBF, hours: Llama 3 405B had 419 unexpected interruptions in 54 days on 2,048
    # nodes (~6,300 node-hours each); 5000 is a round, slightly pessimistic figure
    mtbf_h: float = Field(5000.0, gt=0.0)


class MLPerfConfig(_Section):
    """What the MLPerf log says about the submission (submission_* keys) and where it also goes."""

    org: str = Field("scaleout", min_length=1)  # submission_org
    # submission_platform; None = "<nodes>x<ranks per node> <device>" as the World reports it
    platform: str | None = Field(None, min_length=1)
    division: Literal["closed", "open"] = "closed"
    status: Literal["onprem", "cloud", "preview", "research"] = (
        "onprem"  # the checker's allowed values
    )
    # Also print the :::MLLOG lines on rank 0's stdout (the Slurm log), as NVIDIA's run_and_time.sh
    # does.
    stdout: bool = False


class HPCAI500Config(_Section):
    """HPC-AI500's report mode (BenchCouncil, arXiv 2007.00279; benchcouncil.org/aibench/hpcai500):
    Valid FLOPS = FLOPS x (achieved / ``target``)^n against HPC-AI500's own quality target (ImageNet
    top-1 0.763), not train.target (MLPerf's 0.759). ``epochs``: its fixed-epoch protocol (90 for
    ResNet-50): the run trains exactly that many epochs (train.max_steps must equal epochs x steps
    per epoch) and does not stop at train.target; null = report only, the run stops at
    train.target as usual."""

    target: float = Field(0.763, gt=0.0, le=1.0)
    epochs: int | None = Field(None, ge=1)


class ContainerConfig(_Section):
    """``launch.container``: the image every rank runs in, under ``scaleout slurm run`` and
    submitit (docs/launchers.md, "Containers"). The supervisor itself runs outside the image, on
    the batch host: ``srun`` is not inside a pyxis container (NVIDIA/pyxis#31)."""

    # pyxis/enroot (SuperPODs), passed to every srun exactly as given: --container-image (an
    # enroot URI such as nvcr.io#nvidia/pytorch:24.01-py3, or a .sqsh file), --container-mounts
    # (SRC:DST[:FLAGS],...), --container-workdir, --container-env (NAME,...: pyxis keeps the
    # image's own value of a variable unless named here, NVIDIA/pyxis#124).
    image: str | None = None
    mounts: str | None = None
    workdir: str | None = None
    env: str | None = None
    # Slurm's own OCI containers (Slurm >= 22.05 with runc or crun, the site's oci.conf):
    # srun --container=<bundle> (a folder with config.json and its rootfs).
    bundle: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ContainerConfig:
        if self.bundle and self.image:
            raise ValueError(
                f"launch.container.bundle={self.bundle!r} and launch.container.image="
                f"{self.image!r}: expected one (an OCI bundle or a pyxis image)"
            )
        pyxis_only = [k for k in ("mounts", "workdir", "env") if getattr(self, k)]
        if pyxis_only and not self.image:
            raise ValueError(
                f"launch.container.{pyxis_only[0]}={getattr(self, pyxis_only[0])!r} needs "
                "launch.container.image (pyxis options); an OCI bundle sets mounts and workdir "
                "in its config.json"
            )
        return self


class LaunchConfig(_Section):
    # auto (detect by priority) or a registered environment's name (scaleout.env.ENVIRONMENTS):
    # checked against the registry when validated, so an environment registered later is accepted
    # too.
    env: str = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    nnodes: int = Field(1, ge=1, le=MAX_WORLD)
    nproc_per_node: int = Field(1, ge=1, le=1024)
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    # `scaleout slurm run` (the sbatch scripts): this many attempts in a row dying without a
    # checkpoint past the same step stop the job instead of restarting or requeueing it.
    crash_loop: int = Field(3, ge=1, le=1000)
    # `scaleout slurm run`: nodes of the allocation kept as spares. The step runs on the others
    # (sbatch -N k: k - spares nodes), unless launch.nnodes is given on the command line.
    spares: int = Field(0, ge=0, le=MAX_WORLD)
    container: ContainerConfig = ContainerConfig()

    @field_validator("env")
    @classmethod
    def _registered_env(cls, v: str) -> str:
        choices = ("auto", *detection_order())
        if v not in choices:
            raise ValueError(
                f"launch.env={v!r}: expected {', '.join(map(repr, choices[:-1]))} or "
                f"{choices[-1]!r}"
            )
        return v


class Config(_Section):
    # built when a config is (their validators read the families' and algorithms' tables)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    comm: CommConfig = Field(default_factory=CommConfig)
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mlperf: MLPerfConfig = MLPerfConfig()
    launch: LaunchConfig = LaunchConfig()
    hpcai500: HPCAI500Config | None = None  # HPC-AI500 report mode (Valid FLOPS target, epochs)

    @model_validator(mode="after")
    def _periodic_checkpoints_need_a_dir(self) -> Config:
        c = self.checkpoint
        if c.every_steps and not c.dir:
            raise ValueError(
                f"checkpoint.every_steps={c.every_steps} needs checkpoint.dir (a directory for the "
                "checkpoints); set it, or checkpoint.every_steps=0"
            )
        return self

    @model_validator(mode="after")
    def _auto_comm_needs_a_plain_step(self) -> Config:
        """comm.algorithm=auto switches DataParallel's plan after the first steps, from timings:
        not for the sharded optimizer (its own collectives), CUDA graphs (captured once) or
        deterministic runs (a plan chosen from timings is not reproducible)."""
        if self.comm.algorithm != AUTO:
            return self
        for key, value in (
            ("optim.sharded", self.optim.sharded),
            ("model.cuda_graphs", self.model.cuda_graphs),
            ("train.deterministic", self.train.deterministic),
        ):
            if value:
                raise ValueError(
                    f"comm.algorithm=auto with {key}=true: auto re-plans the replicated "
                    f"all-reduce from timings; set {key}=false or name an algorithm "
                    f"({', '.join(declared()[1].names())})"
                )
        return self

    @model_validator(mode="after")
    def _source_is_the_family_s(self) -> Config:
        fam = declared()[0].get(self.model.arch)
        if self.data.source not in fam.data_sources:
            raise ValueError(
                f"data.source={self.data.source!r}: model.arch={fam.name} reads "
                f"{' or '.join(fam.data_sources)}"
            )
        return self

    @model_validator(mode="after")
    def _init_checkpoint_is_read_by_the_family(self) -> Config:
        families, _ = declared()
        if self.model.init_checkpoint and not families.get(self.model.arch).hf_checkpoints:
            readers = [n for n, f in families.items() if f.hf_checkpoints]
            raise ValueError(
                f"model.init_checkpoint: model.arch={self.model.arch!r} starts from no checkpoint "
                f"(model.arch={' or '.join(readers)} reads one)"
            )
        return self

    def check_world(self, world_size: int, ranks_per_node: int | None = None) -> None:
        """Checks that need the world size; raise ConfigError naming the key."""
        if not 1 <= world_size <= MAX_WORLD:
            raise ConfigError(f"world size {world_size}: expected an integer from 1 to {MAX_WORLD}")
        if ranks_per_node is not None and not 1 <= ranks_per_node <= world_size:
            raise ConfigError(
                f"ranks per node {ranks_per_node}: expected an integer from 1 to the world size "
                f"{world_size}"
            )
        t = self.train
        per_step = world_size * t.grad_accum
        if t.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch={t.global_batch} must be divisible by world size {world_size} "
                "x "
                f"train.grad_accum={t.grad_accum} = {per_step}"
            )
        c = self.comm
        families, algorithms = declared()
        if not c.auto:  # auto: the tuner probes only the algorithms whose check passes
            algorithms.get(c.algorithm).check(c.options(), world_size, ranks_per_node)
        if self.optim.sharded:
            check_sharded_wire(c.algorithm, c.wire_compression, self.optim.shard, world_size)
        families.get(self.model.arch).check(self, world_size)


def check_sharded_wire(
    algorithm: str, compression: str | None, shard: str, world_size: int
) -> None:
    """The sharded LAMB's compressed reduce-scatter over the world is one all-to-all: only
    comm.algorithm=flat sends it (optim.shard=node shards within nodes instead). ConfigError."""
    if compression is not None and shard == "world" and algorithm != "flat" and world_size > 1:
        raise ConfigError(
            f"optim.sharded=true with comm.compression={compression} and "
            f"comm.algorithm={algorithm}: the compressed reduce-scatter is one all-to-all over "
            "the world; expected comm.algorithm=flat or optim.shard=node"
        )
