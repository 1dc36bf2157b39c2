"""Watching the agent: greedy episodes of a checkpoint's policy recorded as a video (mp4) or an
animation (gif), from the environment's own `rgb_array` screen (the full-colour game for Atari,
not the 84x84 grayscale the network sees). One frame after the reset and one per agent step.

Frames go to the H.264 encoder as they are drawn, so a video holds none of them in memory (a
30-minute Atari game is 27,000 frames, 2.7 GB). A GIF is written at the end (Pillow's encoder takes
all frames at once) and holds the frames it keeps, which --max-frames bounds."""
from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hvd_rl.config import MULTIAGENT_ALGORITHMS, ConfigError
from hvd_rl.envs.multiagent import make_multiagent_envs
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.policy.trained import checkpoint_config, load_trained, single_process_env

GIF_MAX_FPS = 50
DEFAULT_MAX_FRAMES = 27_000  # 30 minutes at 15 frames/s (Atari's 60 Hz over a frame skip of 4)


class RenderError(ValueError):
    """The environment cannot give pictures here; the message says what would."""


ATARI_HZ = 60.0  # the console's frame rate; ale-py's render_fps metadata says 30


def _fps(envs: RankEnvs, frame_skip: int) -> float:
    """Real time: one recorded frame per agent step, which is frame_skip console frames on Atari."""
    if envs.atari:
        return ATARI_HZ / frame_skip
    return float(envs.vec.envs[0].metadata.get("render_fps") or 30)


def _screen(envs: Any) -> np.ndarray:
    try:
        frame = envs.render()
    except Exception as exc:  # noqa: BLE001 - each renderer fails in its own way (GL, pygame, ...)
        hint = ""
        if "mujoco" in type(exc).__module__.lower() or "GL" in str(exc) or "gl" in type(exc).__name__.lower():
            hint = (" (MuJoCo draws with OpenGL: set MUJOCO_GL=egl on GPU nodes, or MUJOCO_GL=osmesa with "
                    "Debian's libosmesa6 on CPU nodes)")
        raise RenderError(f"the environment cannot render an rgb_array frame: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}{hint}") from None
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise RenderError(f"the environment's rgb_array frame has shape {frame.shape}, not (height, width, 3)")
    return frame


def _imageio(video: bool) -> Any:
    try:
        import imageio.v2 as imageio
        if video:
            import imageio_ffmpeg  # noqa: F401 - the ffmpeg binary behind imageio's mp4 writer
    except ImportError as exc:
        raise ConfigError(f"recording needs {exc.name}: pip install 'hvd_rl[tools]' "
                          "(scripts/setup.sh installs it)") from None
    return imageio


class Recorder:
    """Takes the frames one at a time: the video's go straight to ffmpeg, the GIF keeps every k-th."""

    def __init__(self, video: Path | None, gif: Path | None, fps: float):
        self.imageio = _imageio(video is not None)
        self.gif, self.fps, self.frames, self.shape = gif, fps, 0, None
        # GIF counts hundredths of a second and viewers slow anything under 20 ms down: above
        # GIF_MAX_FPS (MuJoCo's 125 frames/s) every k-th frame is kept, for the same duration.
        self.gif_step = max(1, math.ceil(fps / GIF_MAX_FPS))
        self.gif_frames: list[np.ndarray] = []
        self.video, self.writer = video, None
        if video is not None:
            video.parent.mkdir(parents=True, exist_ok=True)
            # libx264 needs even sizes; every renderer here gives them, and nothing is resized.
            self.writer = self.imageio.get_writer(video, fps=fps, codec="libx264", quality=7, macro_block_size=2,
                                                  ffmpeg_log_level="error")

    def add(self, frame: np.ndarray) -> None:
        if self.writer is not None:
            self.writer.append_data(frame)
        if self.gif is not None and self.frames % self.gif_step == 0:
            self.gif_frames.append(frame)
        self.frames += 1
        self.shape = frame.shape

    def close(self) -> None:
        """Finishes the video, then writes the GIF."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.gif is not None and self.gif_frames:
            self.gif.parent.mkdir(parents=True, exist_ok=True)
            self.imageio.mimsave(self.gif, self.gif_frames, duration=1000.0 * self.gif_step / self.fps, loop=0)
            self.gif_frames = []

    def abort(self) -> None:
        """A recording that failed leaves no partial video behind."""
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None
                self.video.unlink(missing_ok=True)
        self.gif_frames = []


def record_checkpoint(path: str | Path, video: str | Path | None = None, gif: str | Path | None = None,
                      episodes: int = 1, seed: int = 10_000, max_frames: int = DEFAULT_MAX_FRAMES,
                      overrides: list[str] | None = None,
                      note: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Records `episodes` whole games (Atari: until the game is over, lives included) with greedy
    actions; stops early at `max_frames`. Returns what was written."""
    if video is None and gif is None:
        raise ConfigError("give --video FILE.mp4 and/or --gif FILE.gif")
    if episodes <= 0 or max_frames <= 1:
        raise ConfigError(f"--episodes must be positive and --max-frames > 1, got {episodes} and {max_frames}")
    cfg, state = checkpoint_config(path, overrides)
    if not os.environ.get("DISPLAY"):  # no screen: draw off-screen
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame (classic control, MPE, highway-env)
        os.environ.setdefault("MUJOCO_GL", "egl")  # MuJoCo: EGL (GPU, or Mesa's software EGL)
    _imageio(video is not None)  # a missing encoder is said before any game is played
    if cfg.algorithm in MULTIAGENT_ALGORITHMS:
        # One environment, every agent acting on its own observation, the whole scene in each
        # frame (MPE's arena, the intersection from above); team returns per episode.
        envs = make_multiagent_envs(cfg.env.id, 1, cfg.multiagent.num_agents, cfg.env.max_episode_steps,
                                    render_mode="rgb_array")
        return _record_games(envs, path, cfg, state, video, gif, episodes, seed, max_frames, envs.render_fps,
                             reset=lambda: envs.reset([seed])[0],
                             finished=lambda result: [(e.team_return, e.length, e.stats) for e in result.episodes])
    env_cfg = single_process_env(cfg.env, 1)
    if env_cfg.backend != "sync":
        note(f"env.backend {env_cfg.backend!r} cannot render; recording with 'sync' (the same game semantics: "
             "tests/test_atari_semantics.py)")
        env_cfg = replace(env_cfg, backend="sync")
    envs = RankEnvs(env_cfg, threads=max(1, torch.get_num_threads()), render_mode="rgb_array")
    return _record_games(envs, path, cfg, state, video, gif, episodes, seed, max_frames,
                         _fps(envs, env_cfg.frame_skip), reset=lambda: envs.reset([seed]),
                         finished=lambda result: [(float(r), int(n), None) for r, n in
                                                  zip(result.episode_returns, result.episode_lengths)])


def _record_games(envs: Any, path: str | Path, cfg: Any, state: dict[str, Any], video: str | Path | None,
                  gif: str | Path | None, episodes: int, seed: int, max_frames: int, fps: float,
                  reset: Callable[[], Any], finished: Callable[[Any], list[tuple]]) -> dict[str, Any]:
    """Greedy games of the checkpoint's policy on `envs` (closed at the end), every frame recorded;
    `finished` gives a step's ended episodes as (return, length, statistics or None)."""
    recorder: Recorder | None = None
    try:
        trained = load_trained(path, envs, cfg, state)
        torch.manual_seed(seed)
        obs = reset()
        recorder = Recorder(Path(video) if video else None, Path(gif) if gif else None, fps)
        recorder.add(_screen(envs))
        played: list[tuple] = []
        while len(played) < episodes and recorder.frames < max_frames:
            result = envs.step(trained.algorithm.act(obs, greedy=True))
            recorder.add(_screen(envs))
            played.extend(finished(result))
            obs = result.obs
    except BaseException:
        if recorder is not None:
            recorder.abort()
        raise
    finally:
        envs.close()
    recorder.close()
    height, width = recorder.shape[:2]
    stats = [p[2] for p in played if p[2] is not None]
    return {"checkpoint": str(path), "env_id": cfg.env.id, "global_step": trained.global_step,
            "frames": recorder.frames, "height": int(height), "width": int(width),
            "fps": recorder.fps, "episodes": len(played), "returns": [float(p[0]) for p in played],
            "lengths": [int(p[1]) for p in played], **({"stats": stats} if stats else {}),
            "complete": len(played) >= episodes,
            "video": str(video) if video else None, "gif": str(gif) if gif else None}
