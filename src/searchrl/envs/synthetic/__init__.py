"""The embedded synthetic multi-hop world (`searchrl world`) and its scripted teacher."""

from searchrl.core.config import TeacherConfig
from searchrl.envs.synthetic.teacher import run_teacher, teacher_records
from searchrl.envs.synthetic.world import SPLITS, World, WorldConfig

__all__ = ["SPLITS", "TeacherConfig", "World", "WorldConfig", "run_teacher", "teacher_records"]
