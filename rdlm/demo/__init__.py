"""`rdlm demo`: embedded reasoning tasks and the run that shows the paper's central result on a CPU."""
