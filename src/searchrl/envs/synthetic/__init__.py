"""The embedded synthetic multi-hop world (`searchrl world`) and its scripted teacher."""

from searchrl.envs.synthetic.teacher import TeacherConfig, run_teacher, teacher_records
from searchrl.envs.synthetic.world import SPLITS, World, WorldConfig

__all__ = ["SPLITS", "TeacherConfig", "World", "WorldConfig", "run_teacher", "teacher_records"]
