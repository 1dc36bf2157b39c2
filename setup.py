"""hvd_rl: Horovod-based distributed PPO for Atari and Gymnasium, as an HPC batch application."""
from setuptools import find_packages, setup

# Runtime dependencies. environment.yml must list the same set (tests/test_packaging.py checks).
# Horovod is built from source by scripts/setup.sh (C++17 patch for PyTorch >= 2.1); pip then
# only sees it as satisfied. torch is left open so GPU sites can bring their CUDA build.
INSTALL_REQUIRES = [
    "torch>=2.3",  # torch.amp.GradScaler
    "horovod==0.28.1",
    "gymnasium[mujoco]>=1.0,<2",  # MuJoCo environments (continuous control) with the mujoco package
    "ale-py>=0.12",  # 0.11's vector env counts the episode limit in agent steps (4x too long)
    "numpy>=1.24",
    "mpi4py>=3.1",
    "tensorboard>=2.12",
    "matplotlib>=3.7",
    "opencv-python-headless>=4.8",  # Gymnasium's AtariPreprocessing (sync/async Atari backends)
    # Multi-agent environments (hvd_rl/envs/multiagent.py): PettingZoo's Parallel API, MPE, VMAS,
    # highway-env's intersection (cooperating vehicles)
    "pettingzoo>=1.24",
    "mpe2>=1.0",
    "vmas>=1.4",
    "highway-env>=1.10",
    # Sweeps and seed studies (hvd_rl/cluster/sweeps): samplers, pruners, journal storage, plots
    "optuna>=4.9",
]

setup(
    name="hvd_rl",
    version="0.1.0",
    description="Distributed deep reinforcement learning (PPO) with Horovod for HPC clusters",
    packages=find_packages(include=["hvd_rl", "hvd_rl.*"]),
    python_requires=">=3.9",
    install_requires=INSTALL_REQUIRES,
    # hypothesis: tests/test_config_fuzz.py; allpairspy: tests/test_option_matrix.py;
    # jsonschema, kubernetes-validate (Kubernetes' own schemas), botocore (the AWS Batch API's
    # model): tests/test_deploy.py, offline
    # tools: W&B tracking, videos of the agent (imageio + its ffmpeg; pygame-ce draws classic control:
    # mpe2 and highway-env need pygame-ce, which installs the same `pygame` module as pygame),
    # ONNX export (onnxscript: torch.onnx's exporter) and its check (onnxruntime)
    extras_require={"test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6.80", "allpairspy>=2.5",
                             "jsonschema>=4.18", "kubernetes-validate>=1.30", "botocore>=1.34"],
                    "tools": ["wandb>=0.19", "imageio>=2.34", "imageio-ffmpeg>=0.5", "pygame-ce>=2.3",
                              "onnx>=1.17", "onnxscript>=0.2", "onnxruntime>=1.20"],
                    "docs": ["sphinx>=8", "myst-parser>=4", "furo>=2024.8"]},
    entry_points={"console_scripts": ["hvd-rl=hvd_rl.cli:main"]},
)
