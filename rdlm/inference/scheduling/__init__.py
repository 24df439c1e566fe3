"""The scheduler side of the continuous batch: a request as the scheduler sees it (`request`), the scheduler
that decides everything a step does (`scheduler`), and the plan it hands the runner and the output it takes
back (`plan`, plain host data: the seam with rdlm.inference.runner). No tensor lives here."""
