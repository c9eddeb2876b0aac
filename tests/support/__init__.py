"""What the tests share: real mpiexec jobs with a timeout (mpirun), real parameter
servers on loopback (pserver_util), the finite-difference checker (gradcheck), the
single-process twins of parallel runs (twins), and the MPI programs those jobs run
(mpi_progs/)."""
