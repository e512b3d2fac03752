"""bench.harness.dist_env reads ranks from torchrun-style, MPICH and Open MPI variables."""

import pytest

from bench.harness.dist_env import detect


def test_torchrun_style_variables_win():
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "x",
                  "PMI_RANK": "0", "PMI_SIZE": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 4, 1, 2, "env")
    assert env.num_nodes == 2


def test_mpich():
    env = detect({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.local_size, env.launcher) == (2, 4, 2, 4, "mpich")


def test_open_mpi_with_zcomm_local_size():
    env = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "ZCOMM_LOCAL_SIZE": "2"})  # fmt: skip
    assert (env.launcher, env.local_world_size, env.local_size, env.num_nodes) == ("openmpi", 4, 2, 2)


def test_no_launcher_is_one_rank():
    env = detect({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "outside world size"),
        ({"PMI_RANK": "0", "PMI_SIZE": "4", "ZCOMM_LOCAL_SIZE": "3"}, "not a multiple"),
        ({"PMI_RANK": "zero", "PMI_SIZE": "4"}, "PMI_RANK"),
    ],
)
def test_inconsistent_environment(environ, message):
    with pytest.raises(ValueError, match=message):
        detect(environ)
