from rdlm.cli import console

console()
