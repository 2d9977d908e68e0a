"""The systems compared, the run modes (quick, full) and what each mode measures."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class System:
    """One way of running a workload: which runner script, in which environment, with which phases."""

    key: str
    title: str
    runner: str
    short: str  # for the summary table
    env: str | None = None  # None: the project's environment; else a peer environment (peers.envs)
    load: bool = True  # has a fresh-process load phase
    dispatch: bool = False  # has a wrapper-overhead measurement
    peer: bool = True  # counts as a peer for the "x best peer" ratio
    default: bool = True  # runs unless left out (False: only when asked for, see peers.py --tt-task-metric)
    concurrent: bool = False  # keeps several requests in flight (an async queue), which one caller's call cannot
    serves: str | None = None  # times the artifact another system's tune phase made, in the serving rounds only
    torch_io: bool = False  # takes torch tensors and returns torch tensors, as a call inside a PyTorch program does


SYSTEMS: list[System] = [
    System("eager", "eager PyTorch", "run_torch.py", "eager", peer=False, torch_io=True),
    System("inductor", "torch.compile (Inductor, default mode)", "run_torch.py", "torch.compile", torch_io=True),
    System("ov_compile", 'torch.compile(backend="openvino")', "run_torch.py", "torch.compile(openvino)",
           torch_io=True),
    System("ov_throughput", "OpenVINO by hand: THROUGHPUT hint, AsyncInferQueue", "run_openvino.py",
           "OpenVINO THROUGHPUT", concurrent=True),
    System("ov_latency", "OpenVINO by hand: LATENCY hint, 1 request", "run_openvino.py", "OpenVINO LATENCY"),
    System("ov_int8_throughput", "OpenVINO INT8 by hand: nncf.quantize on the tuning samples, THROUGHPUT hint, "
           "AsyncInferQueue", "run_openvino.py", "OpenVINO INT8 THROUGHPUT", concurrent=True),
    System("ov_int8_latency", "OpenVINO INT8 by hand: nncf.quantize on the tuning samples, LATENCY hint, 1 request",
           "run_openvino.py", "OpenVINO INT8 LATENCY"),
    System("onnxruntime", "ONNX Runtime by hand: torch.onnx.export, CPU provider, default optimizations",
           "run_onnxruntime.py", "ONNX Runtime"),
    System("onnxruntime_int8", "ONNX Runtime INT8 by hand: torch.onnx.export, "
           "onnxruntime.quantization.quantize_dynamic (defaults, QInt8 weights), CPU provider", "run_onnxruntime.py",
           "ONNX Runtime INT8"),
    # The by-hand peers above are timed on a numpy array built once and reused, returning numpy. A PyTorch program
    # holds tensors: these time the same artifacts called with a tensor, converted on each call, and return one.
    System("onnxruntime_torch", "ONNX Runtime by hand, torch tensors in and out: "
           "torch.from_numpy(session.run(None, {name: x.numpy()})[0])", "run_onnxruntime.py",
           "ONNX Runtime, torch I/O", load=False, default=False, serves="onnxruntime", torch_io=True),
    System("onnxruntime_int8_torch", "ONNX Runtime INT8 by hand, torch tensors in and out (as above)",
           "run_onnxruntime.py", "ONNX Runtime INT8, torch I/O", load=False, default=False, serves="onnxruntime_int8",
           torch_io=True),
    System("ov_latency_torch", "OpenVINO by hand, LATENCY hint, torch tensors in and out: "
           "torch.from_numpy(request.infer({0: x.numpy()}, share_inputs=True).to_tuple()[0])", "run_openvino.py",
           "OpenVINO LATENCY, torch I/O", load=False, default=False, serves="ov_latency", torch_io=True),
    System("ov_int8_latency_torch", "OpenVINO INT8 by hand, LATENCY hint, torch tensors in and out (as above)",
           "run_openvino.py", "OpenVINO INT8 LATENCY, torch I/O", load=False, default=False, serves="ov_int8_latency",
           torch_io=True),
    System("aitune", "NVIDIA AITune 0.6 (MaxThroughputStrategy, CPU backends)", "run_aitune.py", "AITune",
           env="aitune", dispatch=True),
    System("navigator", "Triton Model Navigator 0.14 (optimize, MaxThroughput runner)", "run_navigator.py",
           "Navigator", env="navigator", dispatch=True),
    System("tt", "torch_tweak tt.tune (HighestThroughputStrategy, all backends)", "run_tt.py", "torch_tweak",
           dispatch=True, peer=False, torch_io=True),
    System("tt_task", "torch_tweak tt.tune with the task metric (FidelityConfig(metric=...), same bound)",
           "run_tt.py", "torch_tweak (task metric)", load=False, peer=False, default=False, torch_io=True),
    System("tt_loaded", "torch_tweak after tt.save -> tt.load (fresh process)", "run_tt.py",
           "torch_tweak after load", load=False, peer=False, torch_io=True),
]
BY_KEY = {s.key: s for s in SYSTEMS}


@dataclass(frozen=True)
class Mode:
    """How much a run measures."""

    name: str
    batches: dict[str, list[int]]  # workload -> measured batch sizes
    tune_batches: dict[str, list[int]]  # workload -> batch sizes the tuners see
    reps: int  # timed repetitions per batch size
    rep_time: float  # seconds of calls per repetition
    load_reps: int  # fresh load processes per system
    timeout_s: float  # per runner process
    dispatch_reps: int = 5
    skip: dict[str, tuple[str, ...]] = field(default_factory=dict)  # workload -> systems not run on it
    skipped: list[str] = field(default_factory=list)  # what the notes say was left out
    fresh_compiler_cache: bool = True
    serve_rounds: int = 3  # interleaved serving rounds per workload (peers/serve.py)


QUICK = Mode(
    "quick",
    batches={"mlp": [1, 32], "resnet50": [1], "resnet50_random": [1], "bert": [1]},
    tune_batches={"mlp": [1, 2, 8, 32], "resnet50": [1, 2], "resnet50_random": [1, 2], "bert": [1, 2]},
    reps=3, rep_time=0.3, load_reps=1, timeout_s=1800, dispatch_reps=3,
    skip={"resnet50": ("aitune", "navigator"), "bert": ("aitune", "navigator"),
          "resnet50_random": ("inductor", "ov_compile", "ov_throughput", "ov_int8_throughput", "aitune", "navigator",
                              "tt_loaded")},
    skipped=["AITune and Model Navigator run on the MLP only (on the CNN and the encoder each takes 2-4 minutes "
             "to tune on 2 cores; --full runs them everywhere)",
             "the worst-case CNN (random weights, noise inputs) runs only eager, OpenVINO LATENCY and ONNX Runtime "
             "(each in default precision and INT8) and tt.tune (its point is the error of reduced precision; --full "
             "runs everything)",
             "ResNet-50 and the encoder at batch 32 are not measured",
             "the CNN and the encoder are tuned at batch sizes 1 and 2 only (full: up to 32)",
             "one fresh-process load per system (full: 3)",
             "compiler caches persist between quick runs (benchmarks/.peer_envs/cache), so tuning and load times "
             "after the first quick run are warm-cache times; --full starts every system from empty caches"],
    fresh_compiler_cache=False, serve_rounds=2,
)
FULL = Mode(
    "full",
    batches={"mlp": [1, 32], "resnet50": [1, 32], "resnet50_random": [1, 32], "bert": [1, 32]},
    tune_batches={"mlp": [1, 2, 8, 32], "resnet50": [1, 2, 8, 32], "resnet50_random": [1, 2, 8, 32],
                  "bert": [1, 2, 8, 32]},
    reps=3, rep_time=1.0, load_reps=3, timeout_s=1500,
)
MODES = {"quick": QUICK, "full": FULL}
